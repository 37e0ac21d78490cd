# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Accept walk over a verified DraftTree, and the commit plan that follows it.

Slots and positions. During verify the target runs over [root, node_1 .. node_n] appended after the
committed prefix: tree node i sits at KV-cache slot prefix_len + i, with position prefix_len + depths[i].
The root (the previous bonus token) is not in the cache before verify; it is written at slot prefix_len.

The walk: starting at the root, take the target's token at the current node (argmax at T = 0, a sample
otherwise) and move to the child carrying that token; the first node with no such child ends the walk and
its target token is the bonus. Tokens in a row of top_ids are distinct in practice; if two siblings carry
the same token the walk takes the lower node index (the higher-scored one).

The commit: accepted node a_k (a_0 = 0 is the root) has depth k; its KV moves from slot prefix_len + a_k to
slot prefix_len + k, which is also its position. After the moves the cache holds prefix_len + m valid
entries (m = len(accepted)); the bonus is not in the cache: it is the next round's root.
"""
from libc.stdint cimport int32_t, int64_t, INT32_MAX
from libc.string cimport memcpy

from collections import namedtuple

cimport numpy as cnp

from runtime.tree cimport DraftTree, writable_array

cnp.import_array()

__all__ = ["walk", "commit_plan", "CommitPlan", "committed_tokens", "fill_draft_head"]


CommitPlan = namedtuple("CommitPlan", ["src_slots", "dst_positions", "tokens", "new_prefix_len"])
CommitPlan.__doc__ = """What to do after the walk.

src_slots      int32 [k]: cache slots (prefix_len + node index) of the accepted nodes whose KV must move.
dst_positions  int32 [k]: where each goes (prefix_len + depth; slot == position once committed).
               Only nodes with node index != depth are listed: they are a suffix of the accepted path
               (once a_k > k, every later a_j > j), listed in increasing destination order. Every source
               is above every destination of the same or a later pair, but a destination can equal the
               source of an EARLIER pair: apply the moves in list order, or read all sources before
               writing any.
tokens         int32 [m + 1]: the root token, the accepted nodes' tokens (depth order), then the bonus.
               The root was already emitted last round (as its bonus); tokens[1:] are new output.
new_prefix_len prefix_len + m: valid KV entries after the moves (root + accepted nodes).
"""


cdef int _check_tokens_array(object a, str name, Py_ssize_t length) except -1:
    if not isinstance(a, cnp.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    cdef int t = cnp.PyArray_TYPE(<cnp.ndarray>a)
    if t != cnp.NPY_INT32 and t != cnp.NPY_INT64:
        raise TypeError(f"{name} must be int32 or int64, got {a.dtype}")
    if cnp.PyArray_NDIM(<cnp.ndarray>a) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not (cnp.PyArray_ISALIGNED(<cnp.ndarray>a) and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>a)):
        raise ValueError(f"{name} must be aligned and in native byte order")
    if length >= 0 and cnp.PyArray_DIMS(<cnp.ndarray>a)[0] != length:
        raise ValueError(f"{name} must have length {length}, got {cnp.PyArray_DIMS(<cnp.ndarray>a)[0]}")
    return 0


cdef inline cnp.ndarray _empty_int32(Py_ssize_t length):
    # The C call: np.empty through Python costs a few hundred ns, a visible share of a small round.
    cdef cnp.npy_intp dims[1]
    dims[0] = length
    return cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT32, 0)


cdef inline int64_t _read(const char* base, Py_ssize_t i, Py_ssize_t stride, bint is64) noexcept:
    if is64:
        return (<const int64_t*>(base + i * stride))[0]
    return (<const int32_t*>(base + i * stride))[0]


def walk(DraftTree tree not None, target_tokens):
    """Follow the target's tokens down the tree from the root.

    target_tokens: int32 or int64 [n + 1], the target's token at each node (its prediction for the
    position after that node). Returns (accepted, bonus): accepted is a new int32 array of node indices
    starting with 0 (accepted[k] has depth k), bonus the target token at the last accepted node.
    """
    cdef Py_ssize_t rows = tree.n + 1
    _check_tokens_array(target_tokens, "target_tokens", rows)
    cdef const char* target = <const char*>cnp.PyArray_DATA(<cnp.ndarray>target_tokens)
    cdef Py_ssize_t stride = cnp.PyArray_STRIDES(<cnp.ndarray>target_tokens)[0]
    cdef bint is64 = cnp.PyArray_TYPE(<cnp.ndarray>target_tokens) == cnp.NPY_INT64
    cdef const int32_t* tokens = tree.tokens_p
    cdef const int32_t* first_child = tree.first_child_p
    cdef const int32_t* next_sibling = tree.next_sibling_p
    cdef int32_t* path = tree.path_p
    cdef int32_t node = 0, child
    cdef int m = 1
    cdef int64_t want
    path[0] = 0
    while True:
        want = _read(target, node, stride, is64)
        child = first_child[node]
        while child != -1 and tokens[child] != want:
            child = next_sibling[child]
        if child == -1:
            break
        path[m] = child
        m += 1
        node = child
    accepted = _empty_int32(m)
    memcpy(cnp.PyArray_DATA(accepted), path, m * sizeof(int32_t))
    return accepted, want


def commit_plan(DraftTree tree not None, accepted, bonus, Py_ssize_t prefix_len):
    """The KV moves and committed tokens for a walk result (see CommitPlan and the module doc).

    accepted: int32/int64 node indices from walk (root-anchored path); bonus: the walk's bonus token;
    prefix_len: committed tokens in the cache before this round's verify (the root sits at that slot).
    """
    _check_tokens_array(accepted, "accepted", -1)
    cdef Py_ssize_t m = cnp.PyArray_DIMS(<cnp.ndarray>accepted)[0]
    if m < 1:
        raise ValueError("accepted must start with the root (node 0); got an empty array")
    if prefix_len < 0 or prefix_len + tree.n + 1 > INT32_MAX:
        raise ValueError(f"prefix_len must be in [0, 2**31 - {tree.n + 1}], got {prefix_len}")
    cdef int64_t b
    try:
        b = bonus
    except (TypeError, OverflowError):
        raise TypeError(f"bonus must be an integer token id, got {bonus!r}") from None
    if b < 0 or b > INT32_MAX:
        raise ValueError(f"bonus must be in [0, 2**31), got {b}")

    cdef const char* acc = <const char*>cnp.PyArray_DATA(<cnp.ndarray>accepted)
    cdef Py_ssize_t stride = cnp.PyArray_STRIDES(<cnp.ndarray>accepted)[0]
    cdef bint is64 = cnp.PyArray_TYPE(<cnp.ndarray>accepted) == cnp.NPY_INT64
    cdef int64_t node, prev = -1
    cdef Py_ssize_t k, first_moved = m
    for k in range(m):
        node = _read(acc, k, stride, is64)
        if node < 0 or node > tree.n or tree.parents_p[node] != prev:
            raise ValueError(f"accepted is not a root-anchored path of this tree: accepted[{k}] = {node}")
        if node != k and first_moved == m:
            first_moved = k
        prev = node

    src = _empty_int32(m - first_moved)
    dst = _empty_int32(m - first_moved)
    tokens = _empty_int32(m + 1)
    cdef int32_t* src_p = <int32_t*>cnp.PyArray_DATA(src)
    cdef int32_t* dst_p = <int32_t*>cnp.PyArray_DATA(dst)
    cdef int32_t* tok_p = <int32_t*>cnp.PyArray_DATA(tokens)
    for k in range(m):
        node = _read(acc, k, stride, is64)
        tok_p[k] = tree.tokens_p[node]
        if k >= first_moved:
            src_p[k - first_moved] = <int32_t>(prefix_len + node)
            dst_p[k - first_moved] = <int32_t>(prefix_len + k)
    tok_p[m] = <int32_t>b
    return CommitPlan(src, dst, tokens, prefix_len + m)


def committed_tokens(DraftTree tree not None, accepted, bonus):
    """(tokens, first_moved) of a walk's result: the tokens the round emits as a list of ints (the accepted nodes'
    after the root, in depth order, then the bonus) and the first depth k whose node accepted[k] != k (len(accepted)
    when every accepted node already sits at its depth: no KV moves). accepted: int32 / int64 node indices from
    walk. (The numpy and list steps it replaces in the CUDA engine's round cost ~3.5 us on the development
    machine.)"""
    _check_tokens_array(accepted, "accepted", -1)
    cdef Py_ssize_t m = cnp.PyArray_DIMS(<cnp.ndarray>accepted)[0]
    cdef const char* base = <const char*>cnp.PyArray_DATA(<cnp.ndarray>accepted)
    cdef Py_ssize_t stride = cnp.PyArray_STRIDES(<cnp.ndarray>accepted)[0]
    cdef bint is64 = cnp.PyArray_TYPE(<cnp.ndarray>accepted) == cnp.NPY_INT64
    cdef Py_ssize_t k, first_moved = m
    cdef int64_t a
    tokens = []
    for k in range(m):
        a = _read(base, k, stride, is64)
        if a < 0 or a > tree.n:
            raise ValueError(f"accepted[{k}] = {a} is not a node of this tree (n = {tree.n})")
        if a != k and first_moved == m:
            first_moved = k
        if k:
            tokens.append(tree.tokens_p[a])
    tokens.append(int(bonus))
    return tokens, first_moved


def fill_draft_head(start_v, meta_v, compact_src, ctx_rows, ctx_pos, draft_ids, draft_pos, int start, int ctx_start,
                    accepted, int bonus, int prev_m):
    """Write the CUDA engine's draft-stage inputs (views of its pinned state block): start_v[0] = start; the last
    round's commit: meta_v = (ctx_start, m), compact_src[i] = ctx_start + accepted[i] and ctx_rows[i] = accepted[i]
    for i < m (= len(accepted)), ctx_rows[m:prev_m] = 0 (rows the previous commit used), ctx_pos[i] = ctx_start + i;
    the block: draft_ids[0] = bonus, draft_pos[i] = start + i. Every view int32; the block views (compact_src ..
    draft_pos) of one length >= m and >= prev_m. (The numpy writes it replaces cost ~5.4 us on the development
    machine.)"""
    cdef str me = "fill_draft_head"
    cdef int32_t* s_p = <int32_t*>writable_array(start_v, me, "start", cnp.NPY_INT32, 1)
    cdef int32_t* meta_p = <int32_t*>writable_array(meta_v, me, "meta", cnp.NPY_INT32, 1)
    cdef int32_t* src_p = <int32_t*>writable_array(compact_src, me, "compact_src", cnp.NPY_INT32, 1)
    cdef int32_t* rows_p = <int32_t*>writable_array(ctx_rows, me, "ctx_rows", cnp.NPY_INT32, 1)
    cdef int32_t* cpos_p = <int32_t*>writable_array(ctx_pos, me, "ctx_pos", cnp.NPY_INT32, 1)
    cdef int32_t* ids_p = <int32_t*>writable_array(draft_ids, me, "draft_ids", cnp.NPY_INT32, 1)
    cdef int32_t* dpos_p = <int32_t*>writable_array(draft_pos, me, "draft_pos", cnp.NPY_INT32, 1)
    _check_tokens_array(accepted, "accepted", -1)
    cdef Py_ssize_t block = cnp.PyArray_DIMS(<cnp.ndarray>ctx_pos)[0]
    cdef Py_ssize_t m = cnp.PyArray_DIMS(<cnp.ndarray>accepted)[0]
    for a, name in ((compact_src, "compact_src"), (ctx_rows, "ctx_rows"), (draft_ids, "draft_ids"),
                    (draft_pos, "draft_pos")):
        if cnp.PyArray_DIMS(<cnp.ndarray>a)[0] != block:
            raise ValueError(f"fill_draft_head: {name} has {a.shape[0]} entries, ctx_pos {block}")
    if cnp.PyArray_DIMS(<cnp.ndarray>start_v)[0] < 1 or cnp.PyArray_DIMS(<cnp.ndarray>meta_v)[0] < 2:
        raise ValueError("fill_draft_head: start needs 1 entry and meta 2")
    if m > block or prev_m > block or prev_m < 0:
        raise ValueError(f"fill_draft_head: {m} accepted / {prev_m} previous rows do not fit a block of {block}")
    cdef const char* base = <const char*>cnp.PyArray_DATA(<cnp.ndarray>accepted)
    cdef Py_ssize_t stride = cnp.PyArray_STRIDES(<cnp.ndarray>accepted)[0]
    cdef bint is64 = cnp.PyArray_TYPE(<cnp.ndarray>accepted) == cnp.NPY_INT64
    cdef Py_ssize_t i
    cdef int32_t a_i
    s_p[0] = start
    meta_p[0] = ctx_start
    meta_p[1] = <int32_t>m
    for i in range(m):
        a_i = <int32_t>_read(base, i, stride, is64)
        src_p[i] = ctx_start + a_i
        rows_p[i] = a_i
    for i in range(m, prev_m):
        rows_p[i] = 0
    for i in range(block):
        cpos_p[i] = ctx_start + <int32_t>i
        dpos_p[i] = start + <int32_t>i
    ids_p[0] = bonus
