"""The `fivedc` command: every subcommand, its errors (no tracebacks) and its exit codes.

main.py           dispatch: compile, show, verify, run, rehearse, train, export, diff, check, search
arguments.py      the parser: each subcommand's options, one function each
shared.py         what commands share: models and plans loaded, options read
run.py, verify.py, verify_report.py, train.py, train_report.py, train_resume.py: one command each
train_outputs.py  what fivedc train writes, checked by the one output rule before any work
plan_check.py     a saved plan runs only if it is what this fivedc compiles
rehearse.py       fivedc rehearse: one rank of each class on the meta device, peak vs estimate
search.py         fivedc search: the layout search's flags, progress bar, top-K table, --json, -o
fit.py            does a plan fit its GPU, and what would make it fit
screen.py         what a command prints: at most 100 columns (--wide for more), no trailing spaces

Layer 10 (the top): may import anything below.
"""
