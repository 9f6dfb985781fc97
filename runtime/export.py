"""`fivedc export`: a checkpoint consolidated into one safetensors file with the model's own names.

The parameters are read whole through the resharding reader (`runtime/reshard.py`:
every piece of every rank, whatever the layout that saved them). A traced
`file.py:factory` model's checkpoint carries its parameter map (`names_of`: the
`fx/params.ParamMapping` of every IR parameter, and the other names of tied
weights), so the file holds the module's `state_dict` names (`from_ir_params`:
fused projections re-fused, weights back to torch's [out, in], separate experts
unstacked), and `module.load_state_dict(load_file(path))` takes it;
`--strip-prefix model.` drops a wrapper's prefix so that the library's own model
loads it (`LlamaForCausalLM.load_state_dict`, or `from_pretrained` on a folder with
its config.json). A DSL model keeps the IR's qualified names (`layers.0.wq`). The
file's metadata has `format: pt` (what Hugging Face expects) and the step, the
validation loss and the plan's hash of the checkpoint. The same function writes
`best_model.safetensors` during training.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fivedc.errors import FivedcError
from fivedc.frontends.fx.params import ParamMapping, from_ir_params


def names_of(traced, module) -> dict:
    """A traced model's names as JSON: the parameter map, and for tied weights the other
    state_dict names of the same tensor."""
    keys = {m.key for m in traced.params}
    by_tensor: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    aliases = {}
    for names in by_tensor.values():
        first = next((n for n in names if n in keys), None)
        if first is not None and len(names) > 1:
            aliases[first] = [n for n in names if n != first]
    return {"params": [dataclasses.asdict(m) for m in traced.params], "aliases": aliases}


def model_tensors(folder: str | Path, index: dict, *, strip_prefix: str = "", dtype: torch.dtype | None = None
                  ) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters, whole, by the model's own names."""
    from fivedc.runtime.reshard import consolidate

    params = consolidate(folder, index, dtype=dtype)
    names = index.get("names")
    if names:
        mappings = tuple(ParamMapping(**{k: tuple(v) if isinstance(v, list) else v for k, v in m.items()})
                         for m in names["params"])
        try:
            params = from_ir_params(mappings, params)
        except (IndexError, RuntimeError, ValueError) as error:  # well-typed names that do not fit the tensors
            from fivedc.errors import CheckpointError
            from fivedc.runtime.checkpoint_dirs import damaged_hint

            raise CheckpointError(f"the checkpoint {folder} has parameter names (names.params) that do not fit "
                                  f"its tensors: {error}", hint=damaged_hint(Path(folder))) from None
        for key, others in names.get("aliases", {}).items():
            params.update({other: params[key] for other in others if key in params})
    if strip_prefix:
        params = {k[len(strip_prefix):] if k.startswith(strip_prefix) else k: v for k, v in params.items()}
    return {k: v.contiguous().clone() for k, v in params.items()}


def write_model(path: str | Path, tensors: dict[str, torch.Tensor], *, index: dict, inputs: tuple = ()) -> None:
    """One safetensors file, written atomically (`fivedc.files.write_output`)."""
    from safetensors.torch import save_file

    from fivedc.files import write_output

    metadata = {"format": "pt", "fivedc_step": str(index["step"]), "fivedc_plan": index["plan"]["hash"],
                "fivedc_model": index["plan"]["model"]}
    if index.get("val_loss") is not None:
        metadata["fivedc_val_loss"] = repr(index["val_loss"])
    write_output(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), inputs=inputs, what="model")


EXPORT_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_export(args, *, say=print) -> int:
    """`fivedc export CHECKPOINT -o model.safetensors [--strip-prefix P] [--dtype D]`; `say`
    prints a line (the command wraps it to its width)."""
    from fivedc.outputs import Output, check_outputs
    from fivedc.runtime.checkpoint import find_checkpoint, read_index
    from fivedc.runtime.checkpoint_files import check_files

    if args.dtype is not None and args.dtype not in EXPORT_DTYPES:
        raise FivedcError(f"--dtype {args.dtype} is not one of {', '.join(EXPORT_DTYPES)}")
    if Path(args.output).suffix != ".safetensors":
        raise FivedcError(f"-o {args.output}: the model file is .safetensors", hint="e.g. -o model.safetensors")
    folder = find_checkpoint(args.checkpoint, flag="")
    check_outputs([Output("-o", args.output, "model")], inputs=tuple(folder.iterdir()),
                  read_dirs=(args.checkpoint, folder))  # never into the checkpoint read
    index = read_index(folder)
    digests = check_files(folder, index)
    tensors = model_tensors(folder, index, strip_prefix=args.strip_prefix or "",
                            dtype=EXPORT_DTYPES.get(args.dtype) if args.dtype else None)
    write_model(args.output, tensors, index=index)
    count = sum(t.numel() for t in tensors.values())
    names = "the module's state_dict names" if index.get("names") else "the IR's parameter names"
    if not digests:
        say(f"note: {folder} records no digests (saved before fivedc kept them): its bytes were not checked")
    say(f"wrote {args.output}: {len(tensors)} tensors, {count} parameters, step {index['step']} of {folder} "
          f"(saved on mesh {index['plan']['mesh']}), in {names}")
    return 0
