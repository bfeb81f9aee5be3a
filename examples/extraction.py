# %% [markdown]
# # Batch extraction with a shared prefix
#
# Records extracted from short texts with `run_batch`. Every program starts with the same long
# instructions and examples, so after the first request that prefix comes from the radix cache:
# each backend reports the cached tokens of every generation, and the same batch with the cache
# switched off shows what that saves.
#
# Runs on the bundled SmolLM2-135M-Instruct on CPU: `python examples/extraction.py`.

# %%
import time

from pydantic import BaseModel, Field

from radixgen.lang import Runtime, function, gen

INSTRUCTIONS = """You extract people from short texts into JSON records.
Rules:
- name: the person's full name as written in the text.
- age: their age in years as an integer; if the text gives a birth year, compute it for 2026.
- city: the city they live in now, not where they were born or travel to.
- role: their job title in a few words, lower case.
Examples:
Text: "Maria Lopez, 41, teaches chemistry at a school in Valencia."
Record: {"name": "Maria Lopez", "age": 41, "city": "Valencia", "role": "chemistry teacher"}
Text: "Born in 1990 in Lyon, Paul Girard now runs a bakery in Nantes."
Record: {"name": "Paul Girard", "age": 36, "city": "Nantes", "role": "baker"}
Text: "Software engineer Aiko Tanaka (29) moved from Osaka to Berlin last spring."
Record: {"name": "Aiko Tanaka", "age": 29, "city": "Berlin", "role": "software engineer"}
Answer with the record only."""

TEXTS = [
    "Jonas Berg, 35, is a nurse at the central hospital in Oslo.",
    "The new mayor of Porto, Ana Costa, is 52 years old.",
    "Pilot Lucas Meyer (44) lives in Hamburg and flies long-haul routes.",
    "At 27, Chloe Martin opened her own design studio in Bordeaux.",
    "Retired carpenter Piet de Vries, 70, still builds furniture in Utrecht.",
    "Dr. Sara Khan, a 38-year-old surgeon, works in Manchester.",
    "Tomasz Nowak, 31, writes software for a bank in Warsaw.",
    "Elena Rossi is a 46-year-old architect based in Milan.",
]


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=30)
    role: str = Field(max_length=40)


@function
def extract(s, text: str):
    with s.system():
        s += INSTRUCTIONS
    with s.user():
        s += f'Text: "{text}"'
    with s.assistant():
        s += gen("person", json_schema=Person, max_tokens=64, temperature=0)


def run_all(runtime: Runtime) -> tuple[list, float]:
    extract.run(TEXTS[0], backend=runtime)  # warm-up: the first run also compiles the grammar
    start = time.perf_counter()
    states = extract.run_batch([{"text": t} for t in TEXTS], backend=runtime, progress_bar=True)
    return states, time.perf_counter() - start


# %% [markdown]
# ## With the radix cache (the default)

# %%
runtime = Runtime()
states, with_cache_s = run_all(runtime)
runtime.close()
for state in states:
    print(state["person"])
prompt = sum(s.meta("person")["prompt_tokens"] for s in states)
cached = sum(s.meta("person")["cached_tokens"] for s in states)
print(f"{cached} of {prompt} prompt tokens served from the cache ({cached / prompt:.0%}); {with_cache_s:.2f} s")

# %% [markdown]
# ## The same batch with the cache switched off

# %%
runtime = Runtime(disable_radix_cache=True)
uncached_states, without_cache_s = run_all(runtime)
runtime.close()
uncached = sum(s.meta("person")["cached_tokens"] for s in uncached_states)
print(f"cache off: {uncached} cached tokens; {without_cache_s:.2f} s")
print(f"the shared prefix from the cache made the batch {without_cache_s / with_cache_s:.2f}x faster")

# %%
assert all(isinstance(s["person"], Person) for s in states + uncached_states)
assert cached / prompt > 0.5 and uncached == 0
