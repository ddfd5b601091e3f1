"""The flags every worker takes (tests/multiproc.py appends them) -> ``partitioning.distributed.Cluster``."""

from __future__ import annotations

import argparse

from partitioning.distributed import Cluster


def parser(description: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--coordinator_address", required=True)
  p.add_argument("--num_processes", type=int, required=True)
  p.add_argument("--process_id", type=int, required=True)
  return p


def cluster(args: argparse.Namespace) -> Cluster:
  return Cluster(args.coordinator_address, args.num_processes, args.process_id,
                 heartbeat_timeout_s=5, init_timeout_s=60, shutdown_timeout_s=10)
