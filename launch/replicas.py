"""Replicas behind one endpoint: N ``launch.server`` processes and the SGLang Model Gateway.

  python -m launch.replicas --replicas 2 --port 8000 -- --model smollm2-135m

starts two servers on 127.0.0.1 (each pinned to its share of the CPUs; the flags after ``--``
are each server's), waits until both are ready, and puts the gateway (``smg``, a Rust router
maintained by the SGLang project; a phaseserve dependency) on ``--host:--port`` with
``--policy`` (default ``cache_aware``: requests sharing a prefix go to the replica that holds it,
load spreads otherwise). Clients use the OpenAI API at ``http://HOST:PORT/v1``. The gateway
retries a request whose replica cannot be reached, takes a replica out when its ``/ready`` fails
and back when it answers; this launcher restarts a replica that exits (``--restart``). One JSON
line on stdout per event (``ready`` with the URLs, ``replica_exited``, ``replica_restarted``);
SIGINT / SIGTERM stop the gateway, then drain the replicas. Exit 2 on bad flags or when a
replica or the gateway does not come up.

With ``--pd`` the replicas are ``--prefill_replicas`` prefill servers and ``--decode_replicas``
decode servers (``launch.server --kv_role``) behind the gateway's prefill / decode mode: the
gateway sends a request to a prefill server for its prompt (one token), then to a decode server
with the KV handoff; the decode server pulls the prompt's KV pages and decodes
(``serving.api.http_kv``).

Across hosts, start ``launch.server --http_port P`` on each host and the gateway on one:
``python -m smg launch --worker-urls http://host1:P http://host2:P --policy cache_aware
--health-check-endpoint /ready`` (docs/deployment.md).
"""

from __future__ import annotations

import json
import signal
import tempfile
import threading

from absl import flags

from launch import cli
from launch.cli import CliError
from launch.replica_set import POLICIES, ReplicaSet, Spec

_REPLICAS = flags.DEFINE_integer("replicas", 2, "server processes", lower_bound=1)
_PD = flags.DEFINE_bool("pd", False, "prefill and decode in separate servers (--kv_role) behind "
                        "the gateway's prefill / decode mode, instead of --replicas")
_PREFILL_N = flags.DEFINE_integer("prefill_replicas", 1, "--pd: prefill servers", lower_bound=1)
_DECODE_N = flags.DEFINE_integer("decode_replicas", 1, "--pd: decode servers", lower_bound=1)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "the gateway's address")
_PORT = flags.DEFINE_integer("port", 8000, "the gateway's port (0: a free one)", lower_bound=0)
_POLICY = flags.DEFINE_enum("policy", "cache_aware", list(POLICIES), "the gateway's routing policy")
_PIN = flags.DEFINE_bool("pin", True, "each replica on its own share of this process's CPUs")
_RESTART = flags.DEFINE_bool("restart", True, "restart a replica that exits")
_HEALTH = flags.DEFINE_integer("health_interval_s", 5, "the gateway's health-check period",
                               lower_bound=1)
_GRACE = flags.DEFINE_integer("gateway_grace_s", 30, "at SIGTERM, how long the gateway lets "
                              "requests in flight finish", lower_bound=1)
_GATEWAY_ARGS = flags.DEFINE_multi_string("gateway_arg", [], "an extra smg flag (repeatable)")
_WORKDIR = flags.DEFINE_string("workdir", "", "logs and port files (default: a temp directory)")
_READY = flags.DEFINE_float("ready_timeout_s", 900.0, "how long start-up may take")


def main(argv: list[str]) -> None:
  server_args = tuple(argv[1:])
  if not server_args:
    raise CliError("give each server's flags after --, e.g. -- --model smollm2-135m")
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="phaseserve-replicas-")
  roles = (("prefill",) * _PREFILL_N.value + ("decode",) * _DECODE_N.value) if _PD.value else ()
  try:
    rs = ReplicaSet(Spec(len(roles) or _REPLICAS.value, server_args, workdir, host=_HOST.value,
                         port=_PORT.value, policy=_POLICY.value, pin=_PIN.value,
                         health_interval_s=_HEALTH.value, gateway_grace_s=_GRACE.value,
                         gateway_args=tuple(_GATEWAY_ARGS.value), roles=roles))
  except ValueError as e:
    raise CliError(str(e)) from None
  try:
    rs.start(_READY.value)  # stops what it started when it fails or is interrupted
  except (RuntimeError, TimeoutError) as e:
    raise CliError(str(e)) from None
  stop = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stop.set())
  try:
    print(json.dumps({"event": "ready", "url": rs.url + "/v1", "policy": _POLICY.value,
                      "replicas": [{"url": r.url, "cores": list(r.cores), "pid": r.pid,
                                    "role": roles[r.index] if roles else "both"}
                                   for r in rs.replicas],
                      "workdir": workdir}), flush=True)
    if _RESTART.value:
      rs.supervise(stop, lambda event: print(json.dumps(event), flush=True))
    else:
      stop.wait()
  finally:
    rs.stop()


if __name__ == "__main__":
  cli.run(main)
