"""helpers.replicas.assert_in_sync on real gloo groups of 2 ranks: one launch runs every scenario
(each rank returns what each check raised), warm ranks run the synced check and the cost
benchmark. Tiny models with integer-friendly inputs, so the values in the messages are worked by hand.
"""

import pytest
import torch

from _support import warm_ranks
from helpers.engine import launch

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
MOVED = "values moved within the tensor"
DIFFER = "ReplicasDiverged: Replicas differ: rank 1 differs from rank 0"


def _check(model, **kwargs):
    """What assert_in_sync raised (``type: message``), or ``"ok"``."""
    from helpers.replicas import assert_in_sync

    try:
        assert_in_sync(model, **kwargs)
    except Exception as e:  # noqa: BLE001 -- the test reads the type
        return f"{type(e).__name__}: {e}"
    return "ok"


def _one_by_one(weight=1.0):
    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(weight)
    return lin


def synced_steps(rank, world_size, steps=3):
    """A DDP MLP (with BatchNorm buffers) after a few synced steps: checked with everything on."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                  torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)  # each rank its own data, as under a sampler
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        opt.step()
    trained = _check(ddp, buffers=True)  # each rank's BatchNorm statistics of its own last batch
    ddp.eval()
    ddp(torch.randn(5, 4, generator=g))  # DDP sends rank 0's buffers; eval mode keeps them
    return {"trained": trained, "after_eval": _check(ddp, grads=True, buffers=True)}


def scenarios(rank, world_size):
    """Every scenario on both ranks, in one launch; returns {name: what the check raised}."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {"synced": synced_steps(rank, world_size)}
    x = torch.tensor([[1.0 if rank == 0 else 3.0]])

    # the silent bug: one step through ddp.module(x) bypasses the gradient all-reduce
    ddp = DDP(_one_by_one())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp.module(x).sum().backward()  # grad = x: 1 on rank 0, 3 on rank 1
    out["bypass_grads_before_step"] = _check(ddp, grads=True)
    out["bypass_params_before_step"] = _check(ddp)
    opt.step()  # weight 1 - 0.1 * 1 = 0.9 on rank 0, 1 - 0.1 * 3 = 0.7 on rank 1
    out["bypass"] = _check(ddp)
    out["bypass_atol"] = [_check(ddp, atol=a) for a in (0.25, 0.35)]  # sums 0.2 apart, squares 0.32

    # a None grad on one rank only (rank 1 ran backward, rank 0 did not)
    lin = _one_by_one()
    if rank == 1:
        lin(x).sum().backward()
    out["none_grad"] = _check(lin, grads=True)

    # a different model on rank 1 (shapes), then different names: an error, no hang
    out["shape"] = _check(torch.nn.Linear(2, 2 + rank))
    seq = torch.nn.Sequential(torch.nn.Linear(1, 1)) if rank == 0 else torch.nn.ModuleDict({"a": torch.nn.Linear(1, 1)})
    out["names"] = _check(seq)
    out["options"] = _check(_one_by_one(), grads=rank == 1)
    out["after_errors"] = _check(_one_by_one())  # the group still works

    # changed after the wrap: frozen, replaced
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)))
    ddp.module[0].weight.requires_grad_(False)
    out["frozen"] = _check(ddp)
    ddp = DDP(torch.nn.Linear(1, 1))
    with torch.no_grad():
        w = ddp.module.weight.detach().clone()
    ddp.module.weight = torch.nn.Parameter(w)
    out["replaced"] = _check(ddp)
    out.update(modes_and_buffers(rank, world_size))
    out["more"] = more_cases(rank)
    return out


class _Act(torch.nn.Module):
    """A module whose extra_repr() shows a function (its repr holds a memory address)."""

    def __init__(self):
        super().__init__()
        self.act = lambda x: x

    def extra_repr(self):
        return f"act={self.act}"


def more_cases(rank):
    """What a new user's trial found (each passed or crashed before): {case: what the check raised}."""
    out, one = {}, rank == 1

    def seeded(build):
        torch.manual_seed(0)
        return build()

    m = seeded(lambda: torch.nn.Linear(4, 3).double())  # one float64 sign flipped: a digest change of 2**63
    with torch.no_grad():
        m.weight[0, 0] *= -1 if one else 1
    out["float64_sign"] = _check(m)
    m = torch.nn.Module()
    m.register_buffer("count", torch.tensor(5 - 2**63 * one))
    out["int64_top_bit"] = _check(m)
    m = seeded(lambda: torch.nn.Linear(4, 4))
    first = _check(m)
    if one:
        m.weight.data = m.weight.data.t()  # the same memory, another order
    out["transposed_after_a_check"] = (first, _check(m))
    out["class"] = _check(seeded(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2),
                                                             torch.nn.Sigmoid() if one else torch.nn.Tanh())))
    m = seeded(lambda: torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "drop": torch.nn.Dropout()}))
    if one:
        del m["drop"]
    out["module_on_rank_0_only"] = _check(m)
    m = seeded(lambda: torch.nn.Linear(2, 2))
    if not one:
        m.scale = 2.0
    out["attribute_on_rank_0_only"] = _check(m)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16 if one else torch.float32))
    out["dtype_of_zeros"] = _check(m)
    out["double_on_rank_1"] = _check(seeded(lambda: torch.nn.Linear(2, 2).double() if one else torch.nn.Linear(2, 2)))
    out["function_in_extra_repr"] = _check(_Act())
    m = seeded(lambda: torch.nn.Linear(2, 2))
    m.sizes = ([1, 2],)  # not a plain value: not compared
    out["list_in_a_tuple"] = _check(m)
    emb = seeded(lambda: torch.nn.Embedding(10, 3, sparse=True))
    emb(torch.tensor([1, 2])).sum().backward()
    out["sparse_grad"] = _check(emb, grads=True)
    emb(torch.tensor([3 + rank])).sum().backward()
    out["sparse_grad_differs"] = _check(emb, grads=True)
    m = seeded(lambda: torch.nn.Linear(1, 1))
    if one:
        m.weight.grad = None
    else:
        m.weight.grad = torch.zeros_like(m.weight)
    out["zero_grad_and_none"] = _check(m, grads=True)
    import torch.distributed as dist

    out["group_without_this_rank"] = _check(m, group=dist.new_group([0]))
    out.update(second_trial(rank))
    return out


class _Raises(torch.nn.Module):
    def extra_repr(self):
        if torch.distributed.get_rank() == 1:
            raise ValueError("no repr here")
        return "fine"


def second_trial(rank):
    """What a second trial found: {case: what the check raised}."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out, one = {}, rank == 1
    m = torch.nn.Module()
    pair = [("act", torch.nn.ReLU()), ("drop", torch.nn.Dropout(0.1))]
    for name, child in reversed(pair) if one else pair:  # registered in another order
        m.add_module(name, child)
    out["modules_in_another_order"] = _check(m)
    m = torch.nn.Linear(1, 1)
    m.shift = 0.0
    first = _check(m)
    m.shift = -0.0 if one else 0.0  # equal to 0.0 as a key, not as a value
    out["negative_zero_after_a_check"] = (first, _check(m))
    m = torch.nn.Module()
    m.register_buffer("q", torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 0, torch.quint8))
    out["quantized_buffer"] = _check(m, buffers=True)
    m.q = torch.quantize_per_tensor(torch.tensor([1.0, 3.0 if one else 2.0]), 0.5, 0, torch.quint8)
    out["quantized_buffer_differs"] = _check(m, buffers=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    ddp = DDP(net)
    net[1].weight = torch.nn.Parameter(net[1].weight.detach().clone())
    out["compiled_ddp_replaced"] = _check(torch.compile(ddp))
    m = torch.nn.Linear(1, 1)
    m.sizes = tuple(range(2000 + rank))
    out["long_attribute"] = _check(m)
    out["extra_repr_raises_on_rank_1"] = _check(_Raises())
    out["lazy"] = _check(torch.nn.LazyLinear(2))
    return out


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


def modes_and_buffers(rank, world_size, steps=4):
    """A rank left in eval(), counters and buffers that differ, one element that differs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for case in ("healthy", "validate_on_rank_0"):
        ddp = DDP(_bn_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        found = []
        for step in range(steps):
            opt.zero_grad()
            ddp(torch.randn(6, 2, generator=g)).pow(2).mean().backward()
            opt.step()
            if case == "validate_on_rank_0" and step == 1 and rank == 0:
                ddp.module.eval()  # a validate() that never calls train() again
                with torch.no_grad():
                    ddp.module(torch.randn(6, 2, generator=g))
            found.append(_check(ddp, grads=True))
        out[case] = found

    # a plain module: rank 1 runs one more training forward (its counter moves on)
    bn = _bn_model()
    for _ in range(1 + rank):
        bn(torch.ones(3, 2) * torch.arange(3.0)[:, None])
    out["counter"] = _check(bn)
    out["counter_all_buffers"] = _check(bn, buffers=True)

    # a buffer of the model itself that differs (and one submodule left in eval() on rank 1)
    net = _bn_model()
    net.register_buffer("scale", torch.tensor([1.0 + rank]))
    out["root_buffer"] = _check(net, buffers=True)
    net[1].train(rank == 0)
    out["sub_mode"] = _check(net)

    def linear(width, change=None):
        """A seeded ``Linear(width, width)`` whose flat weight ``change`` edits on rank 1."""
        torch.manual_seed(0)
        lin = torch.nn.Linear(width, width)
        with torch.no_grad():
            if rank == 1 and change:
                change(lin.weight.view(-1))
        return lin

    def swap(flat):  # two unsampled elements swapped: the same values, sums and sampled elements
        flat[[1, 2]] = flat[[2, 1]].clone()

    def nudge(flat):  # one element of 10,000, away from the sampled ones, one float32 step apart
        flat[1] = torch.nextafter(flat[1], torch.tensor(float("inf")))

    lin = linear(100, nudge)
    out["one_element"] = _check(lin)
    out["one_element_atol"] = _check(lin, atol=1e-6)
    out["swapped"] = _check(linear(100, swap))
    out["swapped_small"] = _check(linear(8, swap))  # a small tensor: digested by torch.dot
    lin = linear(100)
    first = _check(lin)  # in sync; then rank 1's weight gets new memory
    if rank == 1:
        lin.weight.data = lin.weight.data.flip(0)  # the same values, rows reversed
    out["new_memory_after_a_check"] = (first, _check(lin))

    # modules configured differently on rank 1: the same tensors, other hyperparameters
    torch.manual_seed(0)
    out["dropout"] = _check(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5 if rank == 0 else 0.0)))
    out["batchnorm"] = _check(torch.nn.BatchNorm1d(4, eps=1e-5 * (1 + rank), momentum=0.1 * (1 + rank)))
    custom = torch.nn.Linear(1, 1)
    custom.scale = 1.0 + rank  # a hyperparameter its extra_repr() does not show
    out["attribute"] = _check(custom)
    return out


@pytest.fixture(scope="module")
def launched():
    return launch(scenarios, 2, backend="gloo", timeout=240)


@pytest.fixture(scope="module")
def ranks():
    yield from warm_ranks(timeout=120)


def test_what_passes_passes_and_every_rank_raises_the_same(launched):
    r = launched[0]
    assert r["synced"]["after_eval"] == "ok" and r["after_errors"] == "ok", r
    trained = r["synced"]["trained"]
    assert "buffer '1.running_mean' (8,)" in trained and "SyncBatchNorm" in trained, trained
    assert "parameter" not in trained.split("Buffers:")[0], trained
    assert r["bypass_params_before_step"] == "ok", "parameters still agree before the step"
    assert r["one_element_atol"] == "ok", "a tolerance above the difference lets it pass"
    first, after = r["new_memory_after_a_check"]  # the bits read once are not reused
    assert first == "ok" and MOVED in after, (first, after)
    assert launched[0] == launched[1], "the same error on every rank"
    assert sum(v.startswith("ReplicasDiverged") for v in r.values() if isinstance(v, str)) == 18


@pytest.mark.parametrize("case, says", [
    ("float64_sign", ["parameter 'weight' (3, 4)"]), ("int64_top_bit", ["buffer 'count' ()"]),
    ("class", ["module '1': Tanh on rank 0, Sigmoid on rank 1"]),
    ("module_on_rank_0_only", ["module 'drop' (Dropout) only on rank 0, not on rank 1"]),
    ("attribute_on_rank_0_only", ["the model (Linear): scale=2.0 on rank 0, scale unset (or not a plain value) on "
                                  "rank 1"]),
    ("dtype_of_zeros", ["'w' dtype torch.float32 on rank 0, torch.float16 on rank 1"]),
    ("double_on_rank_1", ["'weight' dtype torch.float32 on rank 0, torch.float64 on rank 1"]),
    ("sparse_grad_differs", ["gradient 'weight' (10, 3)", MOVED]),  # the same values in other rows
    ("zero_grad_and_none", ["gradient 'weight' (1, 1): rank 0 sum=0 sumsq=0; rank 1 None"]),
])
def test_what_a_new_user_found_is_named(launched, case, says):
    """Cases a new user's trial found passing, or named wrongly; each failed on the code before."""
    msg = launched[0]["more"][case]
    assert msg.startswith("ReplicasDiverged: ") and all(s in msg for s in says), msg
    assert MOVED not in msg or MOVED in says, msg


def test_what_a_second_trial_found(launched):
    """Each failed on the code before: a false alarm, a missed difference, a crash, a long message."""
    more = launched[0]["more"]
    assert more["modules_in_another_order"] == "ok" and more["quantized_buffer"] == "ok", more
    first, after = more["negative_zero_after_a_check"]
    assert first == "ok" and "shift=0.0 on rank 0, shift=-0.0 on rank 1" in after, after
    assert "buffer 'q' (2,)" in more["quantized_buffer_differs"], more["quantized_buffer_differs"]
    assert "'1.weight' was added or replaced after the wrap" in more["compiled_ddp_replaced"]
    long = more["long_attribute"]
    assert "sizes=(0, 1, 2" in long and len(long) < 1200, long
    assert "<extra_repr() raised ValueError> on rank 1" in more["extra_repr_raises_on_rank_1"]
    assert more["lazy"].startswith("RuntimeError: assert_in_sync: parameter 'weight' holds no values yet")


def test_weights_stay_cached_past_64_lengths():
    """A model of many sizes: the weights of each length are computed once, not at every call."""
    from helpers.replicas import _position_weights

    cpu = torch.device("cpu")
    for _ in range(2):  # the first call grows the longest kept, the second fills each length
        kept = [_position_weights(1000 + 37 * n, torch.int32, cpu) for n in range(300)]
    assert all(_position_weights(1000 + 37 * n, torch.int32, cpu) is kept[n] for n in range(300))


def test_options_and_shapes_at_many_ranks_in_a_few_lines():
    from helpers.engine import simulate

    options, shapes = zip(*simulate(_many_ranks, 64))
    assert options[0].startswith("ReplicasDiverged: Replicas not compared: ranks 1, 3, 5, 7, 9, 11, 13, 15, ... "
                                 "(32 ranks) call assert_in_sync(grads=True"), options[0]
    assert "hold a different model" not in options[0]
    assert "ranks 1-63 hold a different model" in shapes[0] and len(shapes[0].splitlines()) <= 8, shapes[0]


def _many_ranks(rank, world_size):
    return _check(torch.nn.Linear(1, 1), grads=rank % 2 == 1), _check(torch.nn.Linear(4, 4 + rank))


def test_what_a_new_user_found_passes_when_the_same(launched):
    more = launched[0]["more"]
    for case in ("function_in_extra_repr", "list_in_a_tuple", "sparse_grad", "group_without_this_rank"):
        assert more[case] == "ok", (case, more[case])
    first, after = more["transposed_after_a_check"]
    assert first == "ok" and after.startswith("ReplicasDiverged"), (first, after)
    assert launched[1]["more"]["group_without_this_rank"] == "ok"


def test_many_ranks_against_an_odd_rank_0_say_so():
    """64 simulated ranks, rank 0 the odd one: the ranks that differ as a span, and a line that says
    rank 0 may be the one."""
    from helpers.engine import simulate

    said = simulate(_odd_rank_0, 64)[5]
    assert "ranks 1-63 differ from rank 0" in said and "rank 0 may be the one that differs" in said, said


def _odd_rank_0(rank, world_size):
    torch.manual_seed(rank == 0)
    return _check(torch.nn.Linear(2, 2))


def test_bypass_names_weight_ranks_and_values(launched):
    msg = launched[0]["bypass"]
    assert msg.startswith("ReplicasDiverged: "), msg
    assert "parameter 'weight' (1, 1)" in msg and "rank 1 differs from rank 0" in msg, msg
    assert "rank 0 sum=0.9 sumsq=0.81" in msg and "rank 1 sum=0.7 sumsq=0.49" in msg, msg
    assert "ddp.module(x)" in msg, msg  # the usual causes
    assert len(msg.splitlines()) <= 6, msg
    below, above = launched[0]["bypass_atol"]
    assert below.startswith("ReplicasDiverged") and above == "ok", (below, above)


#: ``(scenario, what its message says)``: every part is in the message, the first at its start
#: when it begins with ``DIFFER``.
MESSAGES = [
    ("bypass_grads_before_step",  # gradients differ while the parameters agree
     [DIFFER, "gradient 'weight' (1, 1): rank 0 sum=1 sumsq=1; rank 1 sum=3 sumsq=9"]),
    ("none_grad", ["gradient 'weight' (1, 1): rank 0 None; rank 1 sum=3 sumsq=9"]),
    ("shape", ["rank 1 holds a different model than rank 0",
               "'weight' shape (2, 2) on rank 0, (3, 2) on rank 1"]),
    ("names", ["'a.weight' only on rank 1", "'0.weight' only on rank 0"]),
    ("options", ["rank 1 calls assert_in_sync(grads=True, buffers=False), rank 0 (grads=False"]),
    ("frozen", ["'0.weight': requires_grad set False after the wrap", "(ranks 0, 1)"]),
    ("replaced", ["'weight' was added or replaced after the wrap"]),
    ("one_element", [DIFFER + " (1 of 2 tensors)", "parameter 'weight' (100, 100): rank 0 sum="]),
    ("swapped", [DIFFER + " (1 of 2 tensors)", MOVED,
                 "parameter 'weight' (100, 100): rank 0 sum="]),
    ("swapped_small", [DIFFER + " (1 of 2 tensors)", "parameter 'weight' (8, 8): rank 0 sum="]),
    ("dropout", [DIFFER + " in module configuration",
                 "module '1' (Dropout): p=0.5 on rank 0, p=0.0 on rank 1"]),
    ("batchnorm", ["the model (BatchNorm1d): eps=1e-05 on rank 0, eps=2e-05 on rank 1",
                   "momentum=0.1 on rank 0, momentum=0.2 on rank 1"]),
    ("attribute", ["the model (Linear): scale=1.0 on rank 0, scale=2.0 on rank 1"]),
]


@pytest.mark.parametrize("scenario, says", MESSAGES, ids=[m[0] for m in MESSAGES])
def test_message_names_what_differs(launched, scenario, says):
    msg = launched[0][scenario]
    assert all(part in msg for part in says), msg
    assert msg.startswith(says[0] if says[0].startswith(DIFFER) else "ReplicasDiverged: "), msg
    if scenario == "bypass_grads_before_step":
        assert "parameter 'weight'" not in msg, "the parameters still agree before the step"


def test_warm_ranks_synced_and_cost(ranks):
    import sys

    import cloudpickle

    from helpers.bench.replicas_cost import cost_worker

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the engines cannot import tests/
    try:
        assert [r["after_eval"] for r in ranks.run(synced_steps)] == ["ok", "ok"]
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    rows = ranks.run(cost_worker, width=8, depth=2, batch=4, repeats=2)
    assert rows[0].keys() == {"world_size", "parameters", "step_s", "check_s", "check_per_step", "full_s",
                              "full_per_step", "target"}
    assert rows[0]["world_size"] == 2 and rows[0]["parameters"] == 2 * (8 * 8 + 8) + 8 + 1


def test_without_a_process_group_says_where_to_call_it():
    from helpers.replicas import assert_in_sync

    with pytest.raises(RuntimeError, match="needs a process group: call it inside the ranks"):
        assert_in_sync(torch.nn.Linear(1, 1))


def test_walk_names_tensors_and_modules_as_torch_does():
    """The check's own walk over a model with a shared submodule and a tied weight: the names and
    order of ``named_parameters()`` and ``named_modules()``, each shared tensor once."""
    from helpers.replicas import _walk

    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(shared, torch.nn.ReLU(), shared),
                                torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 3))
    model[3].weight = shared.weight  # tied
    entries, modes = _walk(model, set(), grads=False, buffers=True)
    params = [n for k, n, *_ in entries if k == "parameter"]
    assert params == [n for n, _ in model.named_parameters()], params
    assert [n for k, n, *_ in entries if k == "buffer"] == [n for n, _ in model.named_buffers()]
    assert [m[0] for m in modes] == [n for n, _ in model.named_modules()], modes


def test_digest_sees_values_moved_but_not_a_float_and_its_negative_swapped():
    """What :func:`helpers.replicas.digests` says it misses: x and -x swapped (their bits differ in
    the top bit only); any other swap of two values changes it."""
    from helpers.replicas import digests

    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.float64):
        a = torch.tensor([0.5, -0.5, 2.0, 3.0], dtype=dtype)
        assert torch.equal(digests([a], cpu), digests([a[[1, 0, 2, 3]]], cpu)), dtype
        assert not torch.equal(digests([a], cpu), digests([a[[0, 1, 3, 2]]], cpu)), dtype


def test_rank_left_in_eval_is_named_at_that_step(launched):
    healthy, broken = launched[0]["healthy"], launched[0]["validate_on_rank_0"]
    assert healthy == ["ok"] * 4, healthy
    assert broken[:1] == ["ok"], broken
    msg = broken[1]  # the check right after rank 0's validate()
    assert msg.startswith("ReplicasDiverged: Replicas differ: rank 1 differs from rank 0 in train()/eval() mode"), msg
    assert "the model (Sequential) and 3 submodules: eval() on rank 0, train() on rank 1" in msg, msg
    assert "validate()" in msg and "model.train()" in msg, msg
    assert "tensors" not in msg, "parameters and gradients still agree at that step"
    later = broken[2]  # rank 0 trained a step in eval(): its BatchNorm counter stopped
    assert "buffer '1.num_batches_tracked' () in BatchNorm1d '1': rank 0 value=2; rank 1 value=3" in later, later


def test_diverged_buffer_named_with_module_and_rank(launched):
    r = launched[0]
    counter = r["counter"]
    assert "rank 1 differs from rank 0 (1 of 7 tensors)" in counter, counter
    assert "buffer '1.num_batches_tracked' () in BatchNorm1d '1': rank 0 value=1; rank 1 value=2" in counter
    assert "stopped updating" in counter and "SyncBatchNorm" not in counter, counter
    assert "buffer '1.running_mean' (4,) in BatchNorm1d '1'" in r["counter_all_buffers"], r["counter_all_buffers"]
    root = r["root_buffer"]
    assert "buffer 'scale' (1,) in Sequential (the model): rank 0 sum=1 sumsq=1; rank 1 sum=2 sumsq=4" in root, root
    assert "module '1' (BatchNorm1d): train() on rank 0, eval() on rank 1" in r["sub_mode"], r["sub_mode"]


def test_bench_command_line_prints_the_ratios(tmp_path, capsys):
    """``python -m helpers.bench replicas``: the step, the every-call check and the full comparison
    side by side, as ratios (structure only; the times depend on the machine)."""
    from helpers.bench import run_benchmarks

    result = run_benchmarks(["replicas"], "smoke", tmp_path)["replicas"]
    out = capsys.readouterr().out
    for col in ("step_ms", "check_ms", "check_per_step", "target", "full_ms", "full_per_step"):
        assert col in out, out
    assert result["target"] == 0.1 and result["check_per_step"] == result["check_s"] / result["step_s"]
    assert (tmp_path / "replicas.json").exists()
