"""The connector's scheduler-side bookkeeping (`LoadSchedule`) through vLLM's calls, preemption included, with
no vLLM process: a claim is loaded only in the step that made it, into the blocks that step gives the request,
and a preempted request that resumes is claimed and loaded again into its new blocks."""
from milo_infer.vllm.transfer import Claim, LoadSchedule

BLOCK = 4  # vLLM's tokens per KV block
PREFIX = 10  # anchor + blocks, in tokens
PROMPT = list(range(14))  # the prefix, then a 4-token query


class Claims:
    """Claims every request whose params say ``{"milo": ...}``, as `PrefixClaims` does one that matches."""

    def claim(self, params, prompt_token_ids):
        if not params:
            return None, "no milo entry in kv_transfer_params"
        return Claim("s", [3, 1], PREFIX, "v1"), ""


def slots_in(blocks: list[int], start: int, end: int) -> list[int]:
    return [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]


def scheduled(schedule: LoadSchedule, req: str, computed: int = 0) -> int:
    """vLLM's two calls before a schedule: how many tokens the connector loads, then their allocation."""
    tokens, _ = schedule.claim(req, {"milo": {}}, PROMPT, computed)
    schedule.allocated(req, tokens)
    return tokens


def test_a_claim_is_loaded_into_the_blocks_of_the_step_that_made_it():
    schedule = LoadSchedule(Claims(), BLOCK)
    assert scheduled(schedule, "a") == PREFIX
    [load] = schedule.loads({"a": ([7, 2, 9, 5],)})
    assert (load.req_id, load.start, load.end) == ("a", 0, PREFIX)
    assert load.slots == (slots_in([7, 2, 9], 0, PREFIX),) and load.block_ids == [7, 2, 9]
    assert schedule.loads({"a": ([7, 2, 9, 5],)}) == []  # decoding steps load nothing more


def test_a_preempted_request_is_loaded_again_into_its_new_blocks_when_it_resumes():
    schedule = LoadSchedule(Claims(), BLOCK)
    scheduled(schedule, "a")
    [first] = schedule.loads({"a": ([7, 2, 9, 5],)})
    # preempted: its blocks go back to vLLM; steps without it load nothing of it, late or not
    assert schedule.loads({}) == []
    assert scheduled(schedule, "a") == PREFIX  # resumed with nothing computed: claimed anew
    [again] = schedule.loads({"a": ([1, 8, 4, 6],)})
    assert again.slots == (slots_in([1, 8, 4], 0, PREFIX),) != first.slots


def test_a_claim_whose_request_is_not_scheduled_is_dropped_not_loaded_later():
    schedule = LoadSchedule(Claims(), BLOCK)
    scheduled(schedule, "a")
    assert schedule.loads({"b": ([0],)}) == []  # vLLM did not run it in the step that claimed it
    assert schedule.loads({"a": ([7, 2, 9],)}) == []  # nor in a later one: it must be claimed again


def test_no_load_without_blocks_a_finished_request_or_the_prefix_computed():
    schedule = LoadSchedule(Claims(), BLOCK)
    tokens, _ = schedule.claim("a", {"milo": {}}, PROMPT, 0)
    schedule.allocated("a", 0)  # vLLM found no room for the external tokens
    assert tokens == PREFIX and schedule.loads({"a": ([7, 2, 9],)}) == []
    scheduled(schedule, "b")
    schedule.finished("b")  # aborted between its claim and the step
    assert schedule.loads({"b": ([7, 2, 9],)}) == []
    assert schedule.claim("c", {"milo": {}}, PROMPT, PREFIX) == (0, "")  # vLLM's own prefix cache had it
    assert schedule.claim("d", None, PROMPT, 0)[0] == 0 and schedule.claim("d", None, PROMPT, 0)[1]


def test_the_last_prompt_token_and_a_partly_computed_prefix():
    schedule = LoadSchedule(Claims(), BLOCK)
    short = PROMPT[:PREFIX]  # a prompt that is all prefix: vLLM computes its last token to sample from
    assert schedule.claim("a", {"milo": {}}, short, 0)[0] == PREFIX - 1
    tokens = scheduled(schedule, "b", computed=BLOCK)  # vLLM's prefix cache holds the first block
    [load] = schedule.loads({"b": ([7, 2, 9],)})
    assert tokens == PREFIX - BLOCK and (load.start, load.end) == (BLOCK, PREFIX)
    assert load.slots == (slots_in([7, 2, 9], BLOCK, PREFIX),) and load.block_ids == [2, 9]


def test_a_window_layers_group_is_loaded_only_into_the_blocks_it_holds():
    """vLLM's hybrid KV cache manager gives a window layer's group its null block (0) for the blocks its window has
    left: those tokens get no slot there (-1), and the full layers' group every slot."""
    schedule = LoadSchedule(Claims(), BLOCK)
    scheduled(schedule, "a")
    [load] = schedule.loads({"a": ([7, 2, 9, 5], [0, 0, 3, 6])})  # a window of <= 2 tokens: only block 2 reached
    full, window = load.slots
    assert full == slots_in([7, 2, 9], 0, PREFIX)
    assert window == [-1] * 2 * BLOCK + slots_in([0, 0, 3], 2 * BLOCK, PREFIX)
    assert load.block_ids == [7, 2, 9, 3]  # no null block: reported on a load error, never written
