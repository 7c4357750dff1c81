"""`shardprep run` on CPU ranks and what transformers gives on the source, for the tests that compare the two
(standalone/test_run.py and the tests beside it, prep/test_mtp.py, runtime/test_gpu_shard_groups.py)."""

import json
import os
import subprocess
import sys

import torch

K = 6


def shardprep_run(out, nproc, *args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "shardprep", "run", str(out), "--nproc", str(nproc), "--json",
                           "--device", "cpu", *map(str, args)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def transformers_outputs(src, prompts, causal, max_new_tokens=K, device="cpu"):
    """(generated token ids, prompt output on the CPU) per prompt, from transformers on the source checkpoint."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model = auto.from_pretrained(src).eval().to(device)
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            enc = tokenizer(prompt, return_tensors="pt")
            if causal:  # what `shardprep run` passes: causal LMs take no token_type_ids
                enc = {k: enc[k] for k in ("input_ids", "attention_mask")}
            enc = {k: v.to(device) for k, v in enc.items()}
            if causal:
                generated = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
                results.append((generated[0, enc["input_ids"].shape[1]:].tolist(), model(**enc).logits.cpu()))
            else:
                results.append(([], model(**enc).last_hidden_state.cpu()))
    return results
