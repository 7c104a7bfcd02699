"""Starts N local processes of a torch.distributed script, one per rank, with
the env:// variables init_process_group reads (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free local port); torchrun does the same where
it works. Exits with the first failing rank's status.

    python3 examples/python/launch.py -n 2 examples/python/quickstart.py
"""

import argparse
import os
import socket
import subprocess
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nproc", type=int, default=2)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    env = dict(os.environ, WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, args.script, *args.args], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(args.nproc)]
    status = [p.wait() for p in ranks]
    sys.exit(next((s for s in status if s != 0), 0))


if __name__ == "__main__":
    main()
