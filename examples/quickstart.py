"""The README quick start: generate with the bundled SmolLM2 on this machine.

    python examples/quickstart.py
"""

from radixgen import Engine, SamplingParams

with Engine() as engine:
    prompt = engine.apply_chat_template([{"role": "user", "content": "What is a radix tree? One sentence."}])
    out = engine.generate(prompt, SamplingParams(max_new_tokens=64, temperature=0))
    print(out.text)
    print(f"[{out.completion_tokens} tokens, finish_reason={out.finish_reason.value}]")
