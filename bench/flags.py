"""The command line the benches that time runs side by side share (`bench/async_speedup.py`,
`swap_modes.py`, `pipeline_modes.py`)."""

from __future__ import annotations

from jaxrlhf.experiments.runner import parse_passthrough
from jaxrlhf.experiments.services import parse_generators


def add_timed_run_arguments(parser, model: str, out: str, generators: bool = False) -> None:
    """The flags the benches that time runs side by side share (`bench/async_speedup.py`,
    `swap_modes.py`, `pipeline_modes.py`): the model, the length of each run and the steps
    left out, the cores of the generator and the learner, running services (`generators`),
    the output folder and `--analyze-only`. Extra `--config.KEY=VALUE` pass through
    (`parse_timed_run_args`)."""
    parser.add_argument("--model", default=model, help="tiny, smollm2, bed or a model folder")
    parser.add_argument("--steps", type=int, default=10, help="updates per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--cpus-generator", default="1")
    parser.add_argument("--cpus-learner", default="0")
    if generators:
        parser.add_argument("--generators", default="",
                            help="SETTING=HOST:PORT,...: run the runs of a swap setting (drain, "
                            "in-flight-keep, in-flight-recompute) against a running service "
                            "(default: start one per setting)")  # fmt: skip
    parser.add_argument("--out", default=out, help="folder for the runs")
    parser.add_argument("--analyze-only", action="store_true",
                        help="recompute from the runs already in --out")  # fmt: skip


def parse_timed_run_args(parser):
    """(args, the `--config.KEY=VALUE` pass-throughs, the running services by swap setting:
    {} without `--generators`)."""
    args, extra = parser.parse_known_args()
    passthrough = parse_passthrough(parser, extra)
    try:
        given = parse_generators(getattr(args, "generators", ""))
    except ValueError as error:
        parser.error(str(error))
    return args, passthrough, given
