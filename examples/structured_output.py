"""A pydantic model as the output schema, with a validator that runs inside the decode loop.

    python examples/structured_output.py
"""

from pydantic import BaseModel, Field

from radixgen import Engine, SamplingParams


class Order(BaseModel):
    order_id: str = Field(pattern=r"^ORD-[0-9]{6}$")
    status: str = Field(json_schema_extra={"enum": ["pending", "shipped", "delivered"]})
    total: float = Field(ge=0, le=10_000)


with Engine() as engine:
    prompt = engine.apply_chat_template(
        [{"role": "user", "content": "Order ORD-000042 was shipped yesterday; it cost 19.90. Give it as JSON."}]
    )
    params = SamplingParams(max_new_tokens=80, temperature=0, json_schema=Order,
                            validators={"$.total": lambda total: total > 0})
    out = engine.generate(prompt, params)
    print(out.text, out.finish_reason.value)
    print(Order.model_validate_json(out.text))
