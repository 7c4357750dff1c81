"""What the tests share and nothing tests itself: import as `from support.checkpoints import make_checkpoint`
(tests/conftest.py puts tests/ on sys.path; the engine folders' modules insert it themselves).

- checkpoints.py: tiny random checkpoints written by transformers' save_pretrained; a script too (README).
- damage.py: flip a byte of an output, for the tests that a damaged output is refused.
- engine_harness.py: what the vLLM and SGLang engine runners share (test plugins, timing lines, a script per DP rank).
- fake_hub.py: a local HTTP server standing in for the hub (HF_ENDPOINT), misbehaving on request.
- fake_server.py: a `ServerAdapter` over plain torch models, for the shared load flows without a server installed.
- fla_kda_reference.py: fla-core's pure-torch KDA and the inputs the K3 op tests of both servers share.
- fp8_fixture.py: block-FP8 quantization of a checkpoint, the way DeepSeek publishes theirs.
- hub_cache.py: a local huggingface_hub cache holding a checkpoint, for the offline hub tests.
- paused.py: wait for a writer process paused mid-way, for tests that act while it waits.
- recipes.py: docs/recipes.md read as data (sections and their commands).
- reconstruct.py: an independent reader rebuilding targets from rank files and the manifest JSON alone.
- runs.py: `shardprep run` on CPU ranks and transformers' outputs on the source, to compare the two.
- sparse_checkpoints.py: checkpoints at their published size whose data is a hole (headers over sparse files).
- spawn_group.py: run a function on N fresh processes forming one torch.distributed group; free ports.
- terminal.py: run a command with its stderr on a pseudo-terminal, as a user's shell gives it.
- trace_reader.py (+ trace_reader.mjs): read a Chrome trace JSON with Chrome DevTools' trace engine under node.
"""
