"""Make a small token data set for `fivedc train`, with no tokenizer: train.bin, val.bin, meta.json.

The files are flat arrays of uint16 token ids, as nanoGPT's `prepare.py` writes them
(`np.array(ids, dtype=np.uint16).tofile(path)`), so nanoGPT's own data sets work too.

    python examples/make_data.py data/                  # a synthetic language, vocabulary 64
    python examples/make_data.py data/ --text book.txt  # characters of a text (at most --vocab distinct)
    fivedc train examples/tiny_llama.5d --mesh 2x1x2x1x1 --data data/train.bin --val data/val.bin

The synthetic language is a Markov chain over ids 1..vocab-1: each id is followed by
one of three successors with probabilities 0.6, 0.3 and 0.1 (drawn once from
`--seed`), in documents of 16 to 256 tokens separated by id 0. A model that learns
the successors reaches a loss near the chain's entropy (printed), far below the
ln(vocab) of guessing. With `--text`, the ids are the text's characters in sorted
order (meta.json lists them); the last tenth of the text is the validation file.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

PROBS = np.array([0.6, 0.3, 0.1])


def markov(tokens: int, *, vocab: int, seed: int) -> tuple[np.ndarray, float]:
    """`tokens` ids of the synthetic language, and its entropy per token in nats."""
    rng = np.random.default_rng(seed)
    successors = np.stack([rng.choice(np.arange(1, vocab), size=3, replace=False) for _ in range(vocab)])
    out = np.empty(tokens, dtype=np.int64)
    i = 0
    while i < tokens:
        length = int(rng.integers(16, 257))
        out[i] = 0  # document boundary
        current = int(rng.integers(1, vocab))
        for j in range(i + 1, min(i + length, tokens)):
            out[j] = current
            current = int(successors[current][rng.choice(3, p=PROBS)])
        i += length
    entropy = -float((PROBS * np.log(PROBS)).sum())
    return out, entropy


def characters(text: str, *, vocab: int) -> tuple[np.ndarray, list[str]]:
    chars = sorted(set(text))
    if len(chars) > vocab:
        raise SystemExit(f"the text has {len(chars)} distinct characters, more than --vocab {vocab}")
    index = {c: i for i, c in enumerate(chars)}
    return np.array([index[c] for c in text], dtype=np.int64), chars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="folder to write train.bin, val.bin and meta.json into")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64, the examples' models)")
    parser.add_argument("--tokens", type=int, default=200_000, help="training tokens (synthetic; default 200000)")
    parser.add_argument("--val-tokens", type=int, default=20_000, help="validation tokens (synthetic)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text", default=None, help="a text file: character-level ids instead")
    args = parser.parse_args(argv)
    if not 2 <= args.vocab <= 65536:
        raise SystemExit(f"--vocab {args.vocab} must be in 2..65536 (uint16 ids)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.text:
        ids, chars = characters(Path(args.text).read_text(), vocab=args.vocab)
        cut = len(ids) * 9 // 10
        train, val, meta = ids[:cut], ids[cut:], {"kind": "characters", "vocab": len(chars), "chars": chars}
    else:
        both, entropy = markov(args.tokens + args.val_tokens, vocab=args.vocab, seed=args.seed)
        train, val = both[:args.tokens], both[args.tokens:]
        meta = {"kind": "markov", "vocab": args.vocab, "seed": args.seed, "entropy_nats": entropy,
                "uniform_nats": math.log(args.vocab)}
    for name, ids in (("train.bin", train), ("val.bin", val)):
        ids.astype(np.uint16).tofile(out / name)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out}/train.bin ({len(train)} tokens), {out}/val.bin ({len(val)} tokens), {out}/meta.json")
    if "entropy_nats" in meta:
        print(f"entropy {meta['entropy_nats']:.3f} nats per token (guessing: ln {args.vocab} = "
              f"{meta['uniform_nats']:.3f}); the first token of each document is random")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
