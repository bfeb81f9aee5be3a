# %% [markdown]
# # Order status: a strict schema with a validator in the decode loop
#
# A customer-service flow: the model reads a customer's message and fills a strict record
# (`order_id` matching a pattern, `status` from an enum, a price within a range). A validator
# checks each value against the order database *while the model writes it*: a wrong value is
# rolled back and resampled on the spot, so the record that comes out is both well-formed and
# true to the records.
#
# Runs on the bundled SmolLM2-135M-Instruct on CPU: `python examples/order_status.py`.

# %%
from typing import Literal

from pydantic import BaseModel, Field

from radixgen.lang import Runtime, function, gen

runtime = Runtime()

ORDERS = {
    "ORD-104233": {"status": "shipped", "price": 89.90},
    "ORD-104288": {"status": "pending", "price": 12.50},
}


class OrderStatus(BaseModel):
    order_id: str = Field(pattern=r"^ORD-[0-9]{6}$")
    status: Literal["pending", "shipped", "delivered", "cancelled"]
    price: float = Field(ge=0, le=5000)


# %% [markdown]
# ## Validators: the records are the truth
#
# Each runs on a value as soon as the model completes it. `False` (or a `ValueError`) rejects it:
# the request rolls back to the value's start, bans the token it began with, and resamples.

# %%
rejected: list[str] = []
current: dict[str, str] = {}


def known_order(order_id: str) -> bool:
    if order_id not in ORDERS:
        rejected.append(f"order_id {order_id!r}: no such order")
        return False
    current["order_id"] = order_id
    return True


def status_on_record(status: str) -> bool:
    expected = ORDERS[current["order_id"]]["status"]
    if status != expected:
        rejected.append(f"status {status!r}: the records say {expected!r}")
        return False
    return True


@function
def order_lookup(s, message: str):
    with s.system():
        s += "Extract the order the customer writes about as JSON with its id, status and price."
    with s.user():
        s += message
    with s.assistant():
        s += gen("order", json_schema=OrderStatus, max_tokens=80, temperature=0,
                 validators={"$.order_id": known_order, "$.status": status_on_record})


# %%
message = ("Hi, my order ORD-104233 shows as delivered on your site but nothing arrived. "
           "I paid 89.90 for it. What is going on?")
state = order_lookup.run(message, backend=runtime)
order = state["order"]
print(order)
print("rejected and resampled:", *rejected, sep="\n  ")

# %% [markdown]
# The customer says *delivered*; the records say *shipped*. The model's first reading was rolled
# back inside the decode loop, and the record that came out agrees with the database:

# %%
assert isinstance(order, OrderStatus)
assert order.order_id in ORDERS and order.status == ORDERS[order.order_id]["status"]
assert 0 <= order.price <= 5000
assert rejected, "the validator rejected at least one value, which was resampled"
rollbacks = runtime.engine.scheduler.stats.num_rollbacks
print(f"rollbacks in the engine: {rollbacks}")
assert rollbacks >= len(rejected)
runtime.close()
