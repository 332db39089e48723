"""What the GPU kit runs: the tests that matter on CUDA, and the two plans (first-contact, full)
with their shapes, loads and time budgets."""

from __future__ import annotations

from dataclasses import dataclass

# Tests that run models or kernels (each through tests/conftest.py's device switch).
KIT_TESTS = (
    "tests/test_triton_attention.py",
    "tests/test_triton_compile.py",
    "tests/test_cuda_graphs.py",
    "tests/test_overlap_outputs.py",
    "tests/test_async_scheduling.py",
    "tests/test_host_syncs.py",
    "tests/test_engine_process.py",
    "tests/test_speculation.py",
    "tests/test_engine_correctness.py",
    "tests/test_decoding_hf_parity.py",
    "tests/test_strategies.py",
    "tests/test_batch_invariance.py",
    "tests/test_prompt_logprobs.py",
    "tests/test_engine_behaviour.py",
    "tests/test_prefix_cache.py",
    "tests/test_overload_and_preemption.py",
    "tests/test_beam_logprobs.py",
    "tests/test_api.py",
    "tests/test_lora.py",  # the LoRA kernel in the engine, token-exact against the merged model
    "tests/test_triton_lora.py",
    "tests/test_seq2seq_engine.py",  # encoder-decoder families, token-exact against generate()
)

# What CUDA changes most, most important first (a failure budget or the deadline may cut the rest):
# the kernel, the graphs, async scheduling and its one read per step, the engine process with
# CUDA's defaults, then token parity with HF generate() (greedy; beams).
FIRST_CONTACT_TESTS = (
    "tests/test_triton_attention.py",
    "tests/test_triton_compile.py::test_serving_after_warm_up_compiles_no_new_kernel_variant",
    "tests/test_triton_compile.py::test_queries_split_across_programs_match_the_reference",
    "tests/test_cuda_graphs.py",
    "tests/test_async_scheduling.py",
    "tests/test_host_syncs.py",
    "tests/test_engine_process.py",
    "tests/test_engine_correctness.py",
    "tests/test_strategies.py::test_beam_search_in_the_engine_equals_hf_generate",
)

EAGER = "--no-cuda-graphs --overlap-outputs off --async-scheduling off"


@dataclass(frozen=True)
class Plan:
    tests: tuple[str, ...]
    shapes: str
    concurrency: str
    num_requests: int
    rounds: int | None  # serving: each level c runs rounds x c of them (None: all, every level)
    output_tokens: str
    rows: str
    steps: int  # engine_overhead's timed steps per pair
    variants: bool  # eager and --torch-compile beside the default
    budget: float  # seconds for the whole kit


PLANS = {
    "first-contact": Plan(
        tests=FIRST_CONTACT_TESTS,
        shapes="llama-1b",
        concurrency="1,16",
        num_requests=32,
        rounds=None,
        output_tokens="32,128",
        rows="16,64",
        steps=20,
        variants=False,
        budget=360.0,
    ),
    "full": Plan(
        tests=KIT_TESTS,
        shapes="llama-1b,llama-8b",
        concurrency="1,16,64,256",
        num_requests=256,
        # All 256 at every level took the 2026-11-28 H100 run's whole serving step to c = 1 of the
        # eager variant (about 1.3 s a request); 2 rounds: 8 requests at c = 1, 256 at c = 256.
        rounds=2,
        output_tokens="32,128",
        rows="16,64,256",
        steps=20,
        variants=True,
        budget=510.0,  # + the grace of a last deadline: within a 10-minute command
    ),
}
