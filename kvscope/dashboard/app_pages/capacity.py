"""Capacity: KV tokens per GPU for a model, and the cache a target hit rate needs for this run's traffic."""

from __future__ import annotations

import streamlit as st

from kvscope.dashboard import capability, charts, data, gpu, reported
from kvscope.dashboard.frame import selection
from kvscope.planning import (
    EXACTNESS,
    GIB,
    KV_DTYPES,
    PRESETS,
    SHARING_NAMES,
    MemoryPlan,
    PlanInputs,
    bytes_per_token,
    cache_curves,
    plan_memory,
    resolve_model,
)
from kvscope.telemetry import display_name


def kv_bytes_per_token(model_name: str, kv_dtype: str, tp: int) -> float | None:
    """One token's KV bytes on one GPU, known even when the model does not fit the GPU."""
    try:
        return bytes_per_token(resolve_model(model_name), kv_dtype, tp).cell_bytes()
    except ValueError:
        return None


def curve_names(sharing: tuple[str, ...]) -> dict[str, str]:
    """Each curve's series name: the plain "token hit rate" for global sharing alone."""
    if sharing == ("global",):
        return {"global": "token hit rate"}
    return {rule: f"token hit rate, {SHARING_NAMES[rule]}" for rule in sharing}


def plan_metrics(plan: MemoryPlan, context: int, page_size: int) -> None:
    metrics = st.columns(4)
    metrics[0].metric("KV bytes per token", f"{plan.token_bytes.cell_bytes(plan.inputs.swa_full_tokens_ratio):,.0f}")
    metrics[1].metric("max KV tokens (SGLang)", f"{plan.sglang.max_total_num_tokens:,}")
    metrics[2].metric(f"pages of {page_size}", f"{plan.sglang.max_total_num_tokens // page_size:,}")
    metrics[3].metric(f"requests of {context:,} tokens at once", f"{plan.sglang_requests_at_context:,}")
    if plan.vllm is not None:
        st.caption(
            f"vLLM at gpu_memory_utilization {plan.inputs.gpu_memory_utilization}: "
            f"{plan.vllm.num_tokens:,} tokens in {plan.vllm.num_gpu_blocks:,} blocks of "
            f"{plan.vllm.block_size} (activation memory not subtracted)"
        )


chosen = selection()
st.header("Capacity")
pool = data.pool_config(chosen.run)
page_size = int(pool.get("page_size", 1))
caps = capability.of(chosen)
capability.source_header(chosen, caps)
page_size = reported.capacity_source(chosen) or caps.block_size or page_size  # the engine's own page size

st.subheader("How many tokens fit")
probed_gib = gpu.total_gib(data.gpus())
cols = st.columns(5)
model_name = cols[0].selectbox(
    "model", sorted(PRESETS), index=sorted(PRESETS).index("llama-3.1-8b"), key="capacity.model"
)
gpu_gib = cols[1].number_input(
    "GPU memory (GiB)",
    1.0,
    4096.0,
    round(probed_gib or 80.0, 1),
    key="capacity.gpu",
    help="this machine's first GPU (pynvml)" if probed_gib else "no GPU here: 80 GiB",
)
tp = int(cols[2].number_input("TP size", 1, 64, 1, key="capacity.tp"))
kv_dtype = cols[3].selectbox("KV dtype", KV_DTYPES, key="capacity.dtype")
context = int(cols[4].number_input("context length", 1, 1_048_576, 8192, key="capacity.context"))
plan: MemoryPlan | None = None
try:
    plan = plan_memory(
        PlanInputs(
            resolve_model(model_name),
            int(gpu_gib * GIB),
            int(gpu_gib * GIB),
            tp_size=tp,
            kv_dtype=kv_dtype,
            page_size=page_size,
            context_len=context,
        )
    )
except ValueError as err:
    st.error(f"{model_name} on {gpu_gib:g} GiB: {err}")
else:
    plan_metrics(plan, context, page_size)

st.subheader("Hit rate vs cache capacity for this run's traffic")
if caps.lacks("request_stream"):
    capability.cannot(caps, "request_stream")
    st.stop()
rule = cache_curves(data.run_config(chosen.run))
try:
    curves, prompt_tokens = data.capacity_curves(
        chosen.path, chosen.run_id, float(chosen.run.started_at or 0.0), page_size, rule.sharing
    )
except ValueError as err:
    st.info(
        f"No hit-rate curve for this run: {str(err).removeprefix(f'{display_name(chosen.path)} run {chosen.run_id}: ')}"
    )
    st.stop()
names = curve_names(rule.sharing)
curve = curves[rule.sharing[0]]
target = st.slider(
    "target token hit rate", 0.0, 1.0, min(0.5, float(curve["hit_rate"].max())), 0.01, key="capacity.target"
)
needed = charts.capacity_for(curve, target)
gpu_tokens = None if plan is None else plan.sglang.max_total_num_tokens
others = {names[r]: curves[r] for r in rule.sharing[1:]}
st.plotly_chart(
    charts.capacity_figure(curve, target, needed, gpu_tokens, name=names[rule.sharing[0]], others=others),
    key="capacity.curve",
)
st.caption(f"**What the curve assumes.** {rule.assumption}")
st.caption(
    f"One pass over {prompt_tokens:,} prompt tokens (stack-distance method): {EXACTNESS}. The axis spans this "
    f"traffic's working set ({charts.working_set_tokens(curve):,} tokens: beyond it the hit rate grows no more)."
    + ("" if plan is not None else " No GPU line: the plan above failed.")
)
if needed is None:
    st.warning(f"No capacity reaches {target:.0%}: this traffic tops out at {curve['hit_rate'].max():.1%}.")
else:
    read_on = f" ({SHARING_NAMES[rule.sharing[0]]})" if others else ""
    st.metric(
        f"capacity for {target:.0%}{read_on}",
        f"{needed:,} tokens",
        help="the smallest cache that reaches the target hit rate on this request stream",
    )
    token_bytes = kv_bytes_per_token(model_name, kv_dtype, tp)
    weights = "" if plan is None else f", beside {plan.inputs.weights_per_gpu_bytes / GIB:,.2f} GiB of weights"
    if token_bytes is not None:
        st.caption(
            f"For {model_name} that is {needed * token_bytes / GIB:,.2f} GiB of KV per GPU at TP {tp} "
            f"({kv_dtype} KV){weights}."
        )
