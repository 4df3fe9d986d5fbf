"""vLLM's side of dvi, in one place: everything that knows vLLM's internals, its plugins, its server and its command line.

- `plugin`: the entry point vLLM calls in each of its processes (inert unless `DVI_LOOP` is set);
- `loop`: dvi's loop in vLLM's processes: the hooks on its engine core, the replica that follows it, the loop's view,
  and the `/dvi/*` relay and request middleware in its API-server process;
- `engine`: `VllmEngine`, vLLM's engine core behind the replica's engine interface (`dvi.engine_api.Engine`);
- `worker`: dvi's extension inside vLLM's worker (the verifications, features and K it reads and sets);
- `middleware`: dvi's request and answer fields on vLLM's OpenAI API (domain tag, per-client cap, the `dvi` field);
- `server`: vLLM's own server as `dvi serve` starts it (command line, environment);
- `__main__`: `python -m dvi.cli.vllm serve ...`, vLLM's own `vllm serve` on either build.

The vLLM release these read is `dvi.hardware.VLLM_RELEASE` (the core's `serve.engine=auto` reads it too). Nothing outside
the shell imports this package: the replica is handed a `VllmEngine` as an engine like any other.
"""
