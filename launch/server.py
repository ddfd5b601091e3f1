"""The gRPC service: phaseserve's API and JetStream's on one port, with health and reflection;
with ``--http_port``, OpenAI's HTTP API beside it (``serving.api.http_server``) over the same engine.

  python -m launch.server --model smollm2-135m --quantize int8 --port 9000 --metrics_port 9100 \
      --http_port 8000

Start-up: load, choose each phase's layout, build the stack (``serving.stack.build`` with its
hooks: the multi-host ``LeaderEngine``, fault injection, restarts), bind (health NOT_SERVING),
warm up every bucketed program, then SERVING. ``--port 0`` / ``--port_file`` for tests. SIGTERM:
drain within ``--grace_s``, exit 0; bad flags exit 2. A loop failure restarts the loop
(``--on_loop_failure=restart``, at most 3 times) or fails the service: every live stream ends
UNAVAILABLE, health NOT_SERVING for ``--failure_exit_delay_s``, exit 1 for the supervisor.
Several processes (``launch.cluster_flags``): process 0 serves and broadcasts each engine call;
the others follow (``serving.multihost``) and stop on its word; a dead process takes the others
down within about ``--heartbeat_timeout_s``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from absl import flags, logging

from launch import cli, cluster_flags, engine_flags as ef
from launch.cli import CliError

_MAX_QUEUE = flags.DEFINE_integer("max_queue", 4096, "requests waiting for prefill; beyond it "
                                  "a 429 queue_full (vLLM and SGLang queue without a bound: a "
                                  "burst of clients waits rather than fails)", lower_bound=1)
_DEFAULT_MAX_TOKENS = flags.DEFINE_integer("default_max_tokens", 256,
                                           "max_tokens when a request gives none",
                                           lower_bound=1)
_MAX_N = flags.DEFINE_integer("max_n", 8, "samples per request", lower_bound=1)
_SLO_CLASSES = flags.DEFINE_string(
    "slo_classes", "interactive:0.45:0.04,server:2:0.2,long:6:0.175",
    "name:ttft_s:tpot_s,... (default: MLPerf Inference v5.0's LLM targets)")
_DEFAULT_SLO = flags.DEFINE_string(
    "default_slo_class", "best_effort", "class of a request naming none (best_effort: never "
    "refused early, as vLLM; a class of --slo_classes: early rejection for every request)")
_SLO_SCALE = flags.DEFINE_float("slo_scale", 1.0, "multiplies every SLO target (slow machines)",
                                lower_bound=0.0)
_EARLY_REJECT = flags.DEFINE_bool("early_reject", True,
                                  "refuse at arrival a request predicted to miss its SLO")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to bind")
_PORT = flags.DEFINE_integer("port", 9000, "gRPC port (0: any free port)", lower_bound=0)
_PORT_FILE = flags.DEFINE_string("port_file", None, "write the bound port here")
_HTTP_PORT = flags.DEFINE_integer("http_port", None, "OpenAI-compatible HTTP port (0: any free "
                                  "port; default: no HTTP server)", lower_bound=0)
_SERVED_MODEL = flags.DEFINE_string("served_model_name", None, "the model id of the HTTP API "
                                    "(default: the model's name)")
_SPECIAL_IN_MESSAGES = flags.DEFINE_bool(
    "special_tokens_in_messages", False, "chat message content may hold control tokens "
    "(<|im_start|> ...) that become control ids, as vLLM and llama.cpp allow; off: content is "
    "text, so no client can forge a system or assistant turn")
_METRICS_PORT = flags.DEFINE_integer("metrics_port", None, "Prometheus /metrics port "
                                     "(0: any free port)", lower_bound=0)
_MAX_MESSAGE = flags.DEFINE_integer("max_message_bytes", 4 << 20, "largest request message",
                                    lower_bound=1024)
_API_KEYS = flags.DEFINE_string("api_keys", None, "JSON file: key -> {name, requests_per_min, "
                                "tokens_per_min, admin}")
_LORA_ADMIN = flags.DEFINE_bool("lora_admin", False, "HTTP: POST /v1/load_lora_adapter and "
                                "/v1/unload_lora_adapter, for --api_keys keys marked admin")
_TLS_CERT = flags.DEFINE_string("tls_cert", None, "PEM certificate (TLS)")
_TLS_KEY = flags.DEFINE_string("tls_key", None, "PEM private key (TLS)")
_USAGE_LOG = flags.DEFINE_string("usage_log", None, "append one JSON line per request here")
_GRACE = flags.DEFINE_float("grace_s", 30.0, "SIGTERM: how long live requests may finish",
                            lower_bound=0.0)
_WATCHDOG = flags.DEFINE_float("watchdog_s", 60.0, "an engine step longer than this fails the "
                               "engine", lower_bound=0.1)
_STALL = flags.DEFINE_float("stream_stall_s", 30.0, "cancel a stream whose client has not read "
                            "for this long", lower_bound=0.1)
_STREAM_BYTES = flags.DEFINE_integer("stream_buffer_bytes", 1 << 20,
                                     "cancel a stream with this much unread", lower_bound=1024)
_ON_LOOP_FAILURE = flags.DEFINE_enum(
    "on_loop_failure", "restart", ["restart", "exit"],
    "after an internal error of the serving loop: rebuild it on the same engine (at most 3 "
    "times) or exit; a fatal engine fault or a hung loop always exits (code 1, for a "
    "supervisor to restart)")
_EXIT_DELAY = flags.DEFINE_float("failure_exit_delay_s", 5.0, "after a loop failure, how long "
                                 "health reports NOT_SERVING before the process exits 1",
                                 lower_bound=0.0)
_KV_ROLE = flags.DEFINE_enum("kv_role", "none", ["none", "prefill", "decode"],
                             "one side of prefill and decode in separate servers (the gateway's "
                             "PD mode, launch.replicas --pd): prefill answers with a KV handoff "
                             "and serves its pages; decode pulls them before decoding; both "
                             "need the host tier (--host_tier_bytes, 256 MiB if 0)")
_KV_URL = flags.DEFINE_string("kv_url", "", "prefill: this server's HTTP base as decode servers "
                              "reach it (default: as the request reached it)")
_WARMUP = flags.DEFINE_bool("warmup", True, "compile every bucketed program before readiness")
_FAULTS = flags.DEFINE_bool("fault_injection", False, "TEST ONLY: client_request_id "
                            "'fault:raise|fatal|hang:S' injects an engine-step fault")
_STEP_DELAY = flags.DEFINE_float("fault_step_delay_s", 0.0, "TEST ONLY (with --fault_injection): "
                                 "every engine step sleeps this long (a slow replica)",
                                 lower_bound=0.0)


def _info(built, limits, classes, version):
  from serving import stack
  from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
  import jax
  cfg, steps, loop = built.cfg, built.steps, built.loop
  d = steps.description
  layout = lambda p: (f"{d[p]['ffn']}:{d[p]['attn']}" if isinstance(d.get(p), dict)
                      and "ffn" in d[p] else "unsharded")
  s = stack.describe(loop)
  return pb.ServerInfoResponse(
      model=cfg.name, dtype=built.dtype, quantize=ef.QUANTIZE.value, defaults=built.defaults,
      mesh=f"{jax.device_count()} x {jax.devices()[0].platform}", mode=d["mode"],
      prefill=pb.PhaseLayout(layout=layout("prefill"), reason=str(d.get("prefill_choice", ""))),
      decode=pb.PhaseLayout(layout=layout("decode"), reason=str(d.get("decode_choice", ""))),
      kv_pages=s["kv_pages"], page_size=s["page_size"], max_slots=s["max_slots"],
      max_context=s["max_context"], max_queue=_MAX_QUEUE.value, max_n=limits.max_n,
      max_stop_strings=limits.max_stop_strings, vocab_size=loop.capacity().vocab_size,
      slo_classes=[pb.SloClass(name=c.name, ttft_s=c.ttft_s, tpot_s=c.tpot_s) for c in classes],
      default_slo_class=limits.default_slo_class, default_max_tokens=limits.default_max_tokens,
      version=version)


def _log_startup(frontend, load_s: float, warm_s: float, b: dict) -> None:
  """Where start-up went: the log line and ``phaseserve_startup_stage_seconds``."""
  logging.info(
      "start-up: load %.1f s, warm-up %.1f s; the programs' time summed over threads: trace "
      "%.1f s, lower %.1f s, compile or cache load %.1f s (cache reads %.1f s; %d hits, %d "
      "misses); the rest of the warm-up runs each program once", load_s, warm_s, b["trace_s"],
      b["lower_s"], b["compile_or_load_s"], b["cache_read_s"], b["cache_hits"],
      b["cache_misses"])
  gauge = frontend.metrics.startup_stage
  for stage, seconds in (("load", load_s), ("warmup", warm_s), ("trace", b["trace_s"]),
                         ("lower", b["lower_s"]), ("compile_or_load", b["compile_or_load_s"]),
                         ("cache_read", b["cache_read_s"])):
    gauge.labels(stage).set(seconds)


def _follow(built: "ef.Built", broadcast) -> None:
  """A process other than 0: no ports; runs process 0's engine calls until it says stop."""
  import jax
  from serving.multihost import follow
  term = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda signum, frame: term.set())
  logging.info("process %d of %d following process 0", jax.process_index(), jax.process_count())
  calls = follow(built.loop.engine, broadcast, term.is_set)
  logging.info("process %d stopped after %d engine calls", jax.process_index(), calls)
  jax.distributed.shutdown()


def _exit_failed(frontend, running, http, term: threading.Event) -> None:
  """The service failed (the watchdog has ended every live stream): health stays NOT_SERVING for
  ``--failure_exit_delay_s`` (a signal cuts it short), then the ports close and the process
  exits 1 so that its supervisor starts a fresh one."""
  logging.error("the serving loop failed: %s; exiting in %.1f s", frontend.loop.dead,
                _EXIT_DELAY.value)
  term.clear()
  term.wait(_EXIT_DELAY.value)
  running.server.stop(grace=1.0).wait(5.0)
  if http is not None:
    http.stop()
  frontend.usage.close()
  logging.error("exit 1 after a loop failure")
  logging.flush()
  os._exit(1)  # the loop thread may be stuck in the engine: do not wait for it


def sampling_defaults(model: str):
  """The HTTP API's sampling defaults: a checkpoint directory's ``generation_config.json``, else
  OpenAI's (``serving.api.http_api.SamplingDefaults``)."""
  import json
  from serving.api import http_api
  path = os.path.join(model, "generation_config.json")
  if not os.path.isfile(path):
    return http_api.SamplingDefaults()
  try:
    with open(path, encoding="utf-8") as f:
      cfg = json.load(f)
  except (OSError, ValueError) as e:
    raise CliError(f"cannot read {path}: {e}")
  if not isinstance(cfg, dict):
    raise CliError(f"{path} is not a JSON object")
  return http_api.defaults_from_generation_config(cfg, path)


def _grammars(tok):
  """The structured-output compiler over the served vocabulary (~0.4 s for SmolLM2's)."""
  from serving.grammar import GrammarCompiler
  t0 = time.monotonic()
  compiler = GrammarCompiler(tok)
  logging.info("structured outputs: llguidance over %d ids, ready in %.2f s", tok.vocab_size,
               time.monotonic() - t0)
  return compiler


def main(argv: list[str]) -> None:
  t_start = time.monotonic()
  logging.set_verbosity(logging.INFO)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  ef.set_fake_devices()
  cluster = cluster_flags.join()
  import importlib.metadata
  import prometheus_client as prom
  from serving.api import admission, grpc_server
  from serving import stack
  from serving.api.auth import ApiKeys
  from serving.api.faults import FaultInjector
  from serving.engine_api import EngineApi
  from serving.multihost import LeaderEngine
  from serving.api.frontend import Frontend, FrontendConfig
  from serving.api.usage import UsageLog
  from serving.api.validation import Limits

  try:
    classes = admission.parse_classes(_SLO_CLASSES.value)
    keys = ApiKeys.load(_API_KEYS.value) if _API_KEYS.value else ApiKeys.none()
  except ValueError as e:
    raise CliError(str(e))
  if _LORA_ADMIN.value and not keys.enabled:
    raise CliError("--lora_admin needs --api_keys with a key marked \"admin\": true (adapter "
                   "loading is never open to anonymous callers)")
  if _DEFAULT_SLO.value not in {c.name for c in classes} | {admission.BEST_EFFORT}:
    raise CliError(f"--default_slo_class {_DEFAULT_SLO.value!r} is not in --slo_classes")
  for path in (_TLS_CERT.value, _TLS_KEY.value):
    if path and not os.path.isfile(path):
      raise CliError(f"no such file: {path}")
  from serving.compiles import ProgramCounter, map_count, rss_bytes
  programs = ProgramCounter()  # every XLA program this process loads, from here on
  registry = prom.CollectorRegistry()
  prom.ProcessCollector(registry=registry)  # process_resident_memory_bytes, open fds, CPU time
  leader: list[LeaderEngine] = []  # process 0 of several: the engine it publishes through
  follower = False
  if cluster.multi:
    from partitioning.distributed import Broadcast, is_leader
    follower = not is_leader()
  if _FAULTS.value and not follower:
    logging.warning("fault injection is ON (test only)")
  faults = FaultInjector(_STEP_DELAY.value) if _FAULTS.value and not follower else None

  def lead(engine: EngineApi) -> EngineApi:
    leader.append(LeaderEngine(engine, Broadcast("engine")))
    return leader[0]

  if _KV_ROLE.value != "none" and not ef.HOST_TIER.value:
    flags.FLAGS["host_tier_bytes"].value = 256 << 20  # pages leave through the host tier
    logging.info("--kv_role %s: host tier of 256 MiB", _KV_ROLE.value)
  if _KV_ROLE.value != "none" and _HTTP_PORT.value is None:
    raise CliError("--kv_role needs the HTTP API (--http_port)")
  built = ef.build(max_waiting=_MAX_QUEUE.value + _MAX_N.value, registry=registry,
                   max_traces=1024, wrap_engine=lead if cluster.multi and not follower else None,
                   fault_hook=faults, restarts=_ON_LOOP_FAILURE.value != "exit")
  cfg, tok, steps, loop = built.cfg, built.tokenizer, built.steps, built.loop
  if follower:
    _follow(built, Broadcast("engine"))
    return
  logging.info("deployment: %s", {k: v for k, v in steps.description.items()
                                  if k in ("mode", "prefill_choice", "decode_choice",
                                           "kv_pools")})
  capacity = loop.capacity()
  limits = Limits(max_context=capacity.max_context,
                  default_max_tokens=_DEFAULT_MAX_TOKENS.value, max_n=_MAX_N.value,
                  slo_classes=tuple(c.name for c in classes),
                  default_slo_class=_DEFAULT_SLO.value,
                  attention_sinks=capacity.attention_sinks, page_size=capacity.page_size,
                  special_in_messages=_SPECIAL_IN_MESSAGES.value)
  frontend = Frontend(loop, tok, FrontendConfig(
      limits, classes, slo_scale=_SLO_SCALE.value, early_reject=_EARLY_REJECT.value,
      max_queue=_MAX_QUEUE.value, stream_buffer_bytes=_STREAM_BYTES.value,
      stream_stall_s=_STALL.value, watchdog_s=_WATCHDOG.value), registry,
      UsageLog(_USAGE_LOG.value), faults=faults, grammars=_grammars(tok), loras=loop.loras)
  frontend.metrics.watch_programs(programs)
  try:
    version = importlib.metadata.version("phaseserve")
  except importlib.metadata.PackageNotFoundError:
    version = "dev"
  info = _info(built, limits, classes, version)
  try:
    running = grpc_server.serve(frontend, keys, info, grpc_server.ServerOptions(
        _HOST.value, _PORT.value, _MAX_MESSAGE.value, tls_cert=_TLS_CERT.value,
        tls_key=_TLS_KEY.value))
  except (OSError, RuntimeError, ValueError) as e:
    raise CliError(f"cannot serve on {_HOST.value}:{_PORT.value}: {e}")
  http = None
  if _HTTP_PORT.value is not None:
    from serving.api import http_server
    defaults = sampling_defaults(ef.MODEL.value)
    logging.info("HTTP sampling defaults (fields a request leaves out): %s", defaults)
    try:
      http = http_server.serve(frontend, keys, registry, http_server.HttpOptions(
          _SERVED_MODEL.value or cfg.name, _HOST.value, _HTTP_PORT.value, _MAX_MESSAGE.value,
          max_context=limits.max_context, defaults=defaults, version=version,
          tls_cert=_TLS_CERT.value, tls_key=_TLS_KEY.value, lora_admin=_LORA_ADMIN.value,
          kv_role=_KV_ROLE.value, kv_url=_KV_URL.value))
    except OSError as e:
      running.server.stop(None)
      raise CliError(str(e))
    logging.info("OpenAI HTTP API on %s://%s:%d/v1", "https" if _TLS_CERT.value else "http",
                 _HOST.value, http.port)
    if _PORT_FILE.value:
      with open(_PORT_FILE.value + ".http", "w") as f:
        f.write(str(http.port))
  if _METRICS_PORT.value is not None:
    metrics_server, _ = prom.start_http_server(_METRICS_PORT.value, addr=_HOST.value,
                                               registry=registry)
    logging.info("metrics on http://%s:%d/metrics", _HOST.value,
                 metrics_server.server_address[1])
    if _PORT_FILE.value:
      with open(_PORT_FILE.value + ".metrics", "w") as f:
        f.write(str(metrics_server.server_address[1]))
  if _PORT_FILE.value:
    with open(_PORT_FILE.value + ".tmp", "w") as f:
      f.write(str(running.port))
    os.replace(_PORT_FILE.value + ".tmp", _PORT_FILE.value)
  logging.info("gRPC on %s:%d (loading)", _HOST.value, running.port)

  term = threading.Event()
  signals = [0]

  def on_signal(signum, frame):
    signals[0] += 1
    if signals[0] > 1:
      frontend.hurry()
    term.set()

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  t0, maps = time.monotonic(), map_count()
  warmed = stack.warmup(loop, ef.WARMUP_THREADS.value or None) if _WARMUP.value else 0
  warm_s = time.monotonic() - t0
  logging.info("warm-up: %d programs in %.1f s (%d XLA programs loaded by the process, %s "
               "memory mappings, RSS %.2f GB)", warmed, warm_s, programs.count,
               map_count(), (rss_bytes() or 0) / 1e9)
  _log_startup(frontend, t0 - t_start, warm_s, programs.breakdown())
  warning = stack.ready(loop, programs, maps, warmed)
  logging.info("ready: RSS %.2f GB after trimming the heap", (rss_bytes() or 0) / 1e9)
  if warning:
    logging.warning("%s", warning)
  loop.start()
  frontend.start_watchdog()
  startup = time.monotonic() - t_start
  frontend.metrics.startup.set(startup)
  if not term.is_set():
    frontend.set_state("serving")
  logging.info("serving (start-up %.1f s)", startup)
  while not term.wait(0.2) and frontend.state != "failed":
    pass
  if frontend.state == "failed":
    _exit_failed(frontend, running, http, term)
  logging.info("draining (grace %.1f s)", _GRACE.value)
  cancelled = frontend.drain(_GRACE.value)
  running.server.stop(grace=1.0).wait(5.0)
  if http is not None:
    http.stop()
  loop.stop(timeout=5.0)
  for lead_engine in leader:
    lead_engine.stop()  # every other process leaves its follow loop
  if cluster.multi:
    import jax
    jax.distributed.shutdown()
  frontend.usage.close()
  logging.info("stopped (%d requests cancelled at the end of the grace period)", cancelled)


if __name__ == "__main__":
  cli.run(main)
