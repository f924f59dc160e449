"""Moved: the tritonserver process manager is tools/triton_server.py (a supervisor with an HTTP front), run by
`make serve` / `make serve-stop`. This stub only says so to whoever runs the old command."""
import sys

if __name__ == "__main__":
    sys.exit("eaglex: `python -m eaglex.engines.triton.server` is gone: use `make serve ENGINE=DIR`, "
             "`make serve-stop`, or `python tools/triton_server.py --help` (docs/triton.md)")
