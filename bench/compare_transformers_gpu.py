"""Decode speed of transformers on a checkpoint (GPU, bf16, greedy), to set beside `mtpx bench --device cuda`.

    mtpx synth --shape 9B --out /tmp/m9
    python3 bench/compare_transformers_gpu.py /tmp/m9 32
    mtpx bench --model /tmp/m9 --device cuda --max-tokens 64 --runs 3

Prints {"transformers_tok_s": ...}: new tokens / seconds of generate() after a 32-token prompt, best of 2.
"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
d, n = sys.argv[1], int(sys.argv[2])
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
ids = torch.tensor([[(i * 7919 + 11) % m.config.vocab_size for i in range(32)]], device="cuda")
with torch.no_grad():
    m.generate(ids, max_new_tokens=8, do_sample=False)
    times = []
    for _ in range(2):
        torch.cuda.synchronize(); t = time.time()
        out = m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize(); times.append(time.time() - t)
print(json.dumps({"model": d, "transformers_tok_s": n / min(times), "new_tokens": out.shape[1] - 32}))
