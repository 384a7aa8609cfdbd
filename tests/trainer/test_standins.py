"""The CPU stand-ins for flash-attn and Liger (tests/standins) are strict: each one pinned to the
library's documented semantics, each one fed deliberately wrong calls that it must refuse or answer
differently. And every call site of the two libraries in longspec/ is exercised under them."""
from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.standins import flash_attn_standin as flash
from tests.standins import liger_standin as liger
from tests.trainer.test_kernels import ce_inputs, naive_attention, naive_ce, rand_qkv

LONGSPEC = Path(__file__).resolve().parents[2] / "longspec"


def bshd(x: torch.Tensor) -> torch.Tensor:
    """(B, nh, T, hd) -> flash-attn's (B, T, nh, hd), bf16."""
    return x.detach().transpose(1, 2).to(torch.bfloat16)


def close(a, b, tol=2e-2) -> bool:
    return torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- flash_attn_func: semantics

def test_causal_mask_is_the_docstring_example():
    """flash_attn_func's docstring: causal, seqlen_q=2 / seqlen_k=5 and 5 / 2, bottom-right aligned."""
    assert flash.visible(2, 5, True).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert flash.visible(5, 2, True).int().tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]


@pytest.mark.parametrize("window", [None, 0, 3, 40])
def test_causal_window_and_gqa_match_the_naive_loop(window):
    q, k, v = rand_qkv(B=2, nh=4, kvh=2, T=17, hd=8)       # 4 query heads over 2 KV heads
    q, k, v = (x.detach().to(torch.bfloat16).double() for x in (q, k, v))
    want = naive_attention(q, k, v, window=window)
    got = flash.flash_attn_func(bshd(q), bshd(k), bshd(v), causal=True,
                                window_size=(-1, -1) if window is None else (window, 0))
    assert got.dtype == torch.bfloat16 and got.shape == (2, 17, 4, 8)
    torch.testing.assert_close(got.transpose(1, 2).double(), want, atol=2e-2, rtol=2e-2)


def test_default_scale_and_natural_log_lse():
    q, k, v = (bshd(x) for x in rand_qkv(B=1, nh=2, kvh=2, T=5, hd=16))
    out, lse, _ = flash.flash_attn_func(q, k, v, return_attn_probs=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(16)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 5)             # (batch, nheads, seqlen_q)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    assert not torch.allclose(lse, torch.logsumexp(scores, -1) / math.log(2))   # not log2
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float())
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    half = flash.flash_attn_func(q, k, v, softmax_scale=0.5 / math.sqrt(16))
    assert not close(half, out, 1e-3)


def test_rows_with_no_key_give_zero_and_infinite_lse():
    q, k, v = (bshd(x) for x in rand_qkv(B=1, nh=2, kvh=1, T=6, hd=8))
    out, lse, _ = flash.flash_attn_func(q, k[:, :2], v[:, :2], causal=True, return_attn_probs=True)
    assert torch.count_nonzero(out[:, :4]) == 0 and torch.count_nonzero(out[:, 4:]) > 0
    assert torch.isinf(lse[..., :4]).all() and (lse[..., :4] > 0).all() and torch.isfinite(lse[..., 4:]).all()


def test_a_window_wider_than_the_keys_is_no_window():
    q, k, v = (bshd(x) for x in rand_qkv(T=9))
    full = flash.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flash.flash_attn_func(q, k, v, causal=True, window_size=(9, 0)), full)
    assert torch.equal(flash.flash_attn_func(q, k, v, causal=True, window_size=(8, -1)), full)


def test_gradients_flow_like_the_kernels():
    q, k, v = (bshd(x).requires_grad_(True) for x in rand_qkv(T=7))
    flash.flash_attn_func(q, k, v, causal=True, window_size=(2, 0)).float().pow(2).sum().backward()
    assert all(torch.isfinite(x.grad).all() and x.grad.dtype == torch.bfloat16 for x in (q, k, v))


# ----------------------------------------------------------------------------- flash_attn_func: wrong calls

def test_a_window_one_key_too_wide_differs():
    q, k, v = rand_qkv(T=20, hd=8)
    q, k, v = (x.detach().to(torch.bfloat16).double() for x in (q, k, v))
    want = naive_attention(q, k, v, window=4).transpose(1, 2)             # keys t-4 .. t: 5 keys
    right = flash.flash_attn_func(bshd(q), bshd(k), bshd(v), causal=True, window_size=(4, 0))
    wide = flash.flash_attn_func(bshd(q), bshd(k), bshd(v), causal=True, window_size=(5, 0))
    assert close(right, want)
    assert not close(wide, want)


def test_top_left_causal_alignment_differs():
    """A caller that assumed query i sees keys 0..i with fewer queries than keys gets another answer."""
    q, k, v = rand_qkv(T=10, hd=8)
    q, k, v = (x.detach().to(torch.bfloat16).double() for x in (q, k, v))
    q3 = q[:, :, :3]
    top_left = torch.zeros(3, 10, dtype=torch.bool)
    for i in range(3):
        top_left[i, : i + 1] = True
    bottom_right = torch.zeros(3, 10, dtype=torch.bool)
    for i in range(3):
        bottom_right[i, : i + 8] = True
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    as_top_left = F.scaled_dot_product_attention(q3, kr, vr, attn_mask=top_left).transpose(1, 2)
    as_bottom_right = F.scaled_dot_product_attention(q3, kr, vr, attn_mask=bottom_right).transpose(1, 2)
    got = flash.flash_attn_func(bshd(q3), bshd(k), bshd(v), causal=True)
    assert close(got, as_bottom_right)
    assert not close(got, as_top_left)


def test_transposed_layout_is_refused_or_differs():
    q, k, v = rand_qkv(B=1, nh=4, kvh=2, T=6, hd=8)
    want = flash.flash_attn_func(bshd(q), bshd(k), bshd(v), causal=True)
    qh, kh, vh = (x.detach().to(torch.bfloat16) for x in (q, k, v))       # (B, nh, T, hd): heads first
    got = flash.flash_attn_func(qh, kh, vh, causal=True)                   # read as 6 heads over 6 KV heads
    assert got.shape == qh.shape and not close(got.transpose(1, 2), want)
    with pytest.raises(RuntimeError, match="must divide"):
        flash.flash_attn_func(bshd(q), kh.transpose(2, 3), vh.transpose(2, 3))   # 4 heads over 8 "heads"
    with pytest.raises(RuntimeError, match="v must have shape"):
        flash.flash_attn_func(bshd(q), bshd(k), vh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp32_is_refused_like_the_kernel(dtype):
    q, k, v = (x.detach().transpose(1, 2).to(dtype) for x in rand_qkv())
    with pytest.raises(RuntimeError, match="FlashAttention only support fp16 and bf16 data type"):
        flash.flash_attn_func(q, k, v, causal=True)


def test_other_refusals():
    q, k, v = (bshd(x) for x in rand_qkv())
    with pytest.raises(RuntimeError, match="query and key must have the same dtype"):
        flash.flash_attn_func(q, k.half(), v)
    with pytest.raises(RuntimeError, match="head dimension at most 256"):
        big = torch.zeros(1, 4, 2, 264, dtype=torch.bfloat16)
        flash.flash_attn_func(big, big, big)
    with pytest.raises(RuntimeError, match="must divide"):
        flash.flash_attn_func(q[:, :, :3], k, v)


# ----------------------------------------------------------------------------- Liger

def test_liger_is_the_mean_over_labelled_rows():
    hidden, weight, labels = ce_inputs()
    assert (labels == -100).any()
    loss_fn = liger.LigerFusedLinearCrossEntropyLoss()                   # ignore_index=-100, mean
    got = loss_fn(weight, hidden, labels)
    torch.testing.assert_close(got, naive_ce(hidden, weight, labels))
    kept = labels != -100
    torch.testing.assert_close(got, F.cross_entropy(hidden[kept] @ weight.T, labels[kept]))
    assert not torch.allclose(got, F.cross_entropy(hidden @ weight.T, labels.clamp(min=0)))


def test_liger_wrong_calls_are_refused_or_differ():
    hidden, weight, labels = ce_inputs(N=40, H=16, V=37)
    mean = liger.LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")
    with pytest.raises(ValueError, match="target must be"):
        mean(hidden, weight, labels)                                      # (_input, lin_weight): swapped
    with pytest.raises(ValueError, match="argument order"):
        mean(hidden[:, :8], weight, labels)                               # hidden of the wrong width
    with pytest.raises(TypeError):
        liger.LigerFusedLinearCrossEntropyLoss(-100)                      # positional: ce_weight in 0.8
    summed = liger.LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, hidden, labels)
    assert not torch.allclose(summed, mean(weight, hidden, labels))
    other = liger.LigerFusedLinearCrossEntropyLoss(ignore_index=5)(weight, hidden, labels.clamp(min=0))
    assert not torch.allclose(other, mean(weight, hidden, labels))
    with pytest.raises(RuntimeError):
        mean(weight.double(), hidden, labels)                             # dtypes meet in one matmul


# ----------------------------------------------------------------------------- every call site covered

# Each function in longspec/ that calls into flash-attn or Liger -> the test that runs it under the
# stand-ins and checks (through the stand-ins' CALLERS) that the call came from that very function.
COVERED = {
    ("model/attention.py", "_flash_attention", "flash_attn_func"):
        "tests/trainer/test_reference_parity.py::test_fused_path_matches_the_dense_reference",
    ("model/kernels.py", "linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss"):
        "tests/trainer/test_reference_parity.py::test_fused_path_matches_the_dense_reference",
    ("decode/tree_attn.py", "_flash_prefix", "flash_attn_func"):
        "tests/trainer/test_fused_dispatch.py::test_tree_decode_under_the_standins_equals_greedy",
}
LIBRARY = re.compile(r"flash_attn|liger_kernel")
IMPORT_LINE = re.compile(r"^\s*(from|import)\s+(flash_attn|liger_kernel)\b")


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _library_imports(node) -> dict[str, str]:
    """Names bound by ``from flash_attn/liger_kernel... import X [as Y]`` / ``import flash_attn`` under node."""
    names = {}
    for n in ast.walk(node):
        if isinstance(n, ast.ImportFrom) and LIBRARY.match(n.module or ""):
            names.update({a.asname or a.name: a.name for a in n.names})
        if isinstance(n, ast.Import):
            names.update({a.asname or a.name: a.name for a in n.names if LIBRARY.match(a.name)})
    return names


def call_sites() -> tuple[set, dict]:
    """Every call in longspec/ of a flash-attn / Liger object, as (file, function, library name): a
    name imported from the libraries, a module attribute of theirs, or what an accessor returns (a
    function that imports the name and returns it, e.g. kernels._flash_attn_func). Also returns the
    accessors {(file, function): name}."""
    trees = {p.relative_to(LONGSPEC).as_posix(): ast.parse(p.read_text()) for p in sorted(LONGSPEC.rglob("*.py"))}
    accessors = {}
    for file, tree in trees.items():
        for fn in _functions(tree):
            returned = {n.value.id for n in ast.walk(fn) if isinstance(n, ast.Return) and isinstance(n.value, ast.Name)}
            for local, name in _library_imports(fn).items():
                if local in returned:
                    accessors[(file, fn.name)] = name
    by_name = {fn: name for (_, fn), name in accessors.items()}

    def accessor_call(node):
        f = node.func if isinstance(node, ast.Call) else None
        key = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        return by_name.get(key)

    found = set()
    for file, tree in trees.items():
        module_names = {k: v for k, v in _library_imports(tree).items()}
        for fn in _functions(tree):
            if (file, fn.name) in accessors:
                continue
            bound = {**module_names, **_library_imports(fn)}
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and accessor_call(n.value):
                    bound.update({t.id: accessor_call(n.value) for t in n.targets if isinstance(t, ast.Name)})
            for n in ast.walk(fn):
                if not isinstance(n, ast.Call):
                    continue
                f = n.func
                if isinstance(f, ast.Name) and f.id in bound:
                    found.add((file, fn.name, bound[f.id]))
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in bound:
                    found.add((file, fn.name, f.attr))                         # flash_attn.flash_attn_func(...)
                elif accessor_call(f):
                    found.add((file, fn.name, accessor_call(f)))               # accessor()(...)
    return found, accessors


def _enclosing(tree, line: int) -> str | None:
    inner = None
    for fn in _functions(tree):
        if fn.lineno <= line <= fn.end_lineno and (inner is None or fn.lineno >= inner.lineno):
            inner = fn
    return inner.name if inner else None


def test_every_call_site_is_covered_by_a_standin_test():
    sites, accessors = call_sites()
    assert sites, "no call of flash-attn / Liger found in longspec/"
    # grep: every import of the libraries sits in an accessor or in a call site the AST walk found
    for path in sorted(LONGSPEC.rglob("*.py")):
        rel = path.relative_to(LONGSPEC).as_posix()
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for i, line in enumerate(lines, 1):
            if IMPORT_LINE.match(line):
                fn = _enclosing(tree, i)
                known = (rel, fn) in accessors or any(s[:2] == (rel, fn) for s in sites)
                assert known, f"longspec/{rel}:{i} imports a GPU library outside any known call site"
    uncovered = sites - COVERED.keys()
    assert not uncovered, f"call sites of flash-attn / Liger with no stand-in test: {sorted(uncovered)}"
    stale = COVERED.keys() - sites
    assert not stale, f"COVERED lists call sites that no longer exist: {sorted(stale)}"
    root = Path(__file__).resolve().parents[2]
    for site, test in COVERED.items():
        file, name = test.split("::")
        assert f"def {name}(" in (root / file).read_text(), (site, test)
