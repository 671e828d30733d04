# Ran at 9cbcb70 (new) and 885154e (old, a worktree with its own venv); see reports/README.md for rerunning.
"""TTFT of a short chat prompt on a plain engine with a 1024-token prompt limit (the server's default shape)."""
import statistics, sys, time
from specjax.api import LLM
from specjax.config import SamplingParams
from specjax.runners.serving import EngineOptions, ServingEngine
llm = LLM("smollm2-135m", "float32")
eng = ServingEngine(llm, None, EngineOptions(max_batch=8, max_prompt_tokens=1024, max_tokens=64)).start()
ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}]))
out = []
for i in range(12):
    r, _ = eng.generate(ids, SamplingParams(max_tokens=1, temperature=0))
    out.append(r.time_to_first_token * 1000)
eng.shutdown()
print(sys.argv[1], "prompt tokens", len(ids), "TTFT ms median", round(statistics.median(out[2:]), 1), "all", [round(x) for x in out[2:]])
