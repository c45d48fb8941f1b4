/* Best-first trees on CPU: the n best nodes of each request's top-K lattice, by lazy merges.
 *
 * The CPU path of sglang_bastion/tree/builder.py (build_trees_compiled). Heap-free, and it
 * visits only about n + K * D lattice nodes per request:
 *
 *   - Depth d's nodes, best first, are a merge of K lists: for each rank k, "depth-(d-1)
 *     node i + the rank-k token of q_d" for i = 0, 1, ... in depth d-1's own best-first
 *     order. Each of those lists is descending because float addition is monotone. So depth
 *     d's best-first list is produced one node at a time by taking the best list head, and a
 *     list head only needs depth d-1's list to be produced up to that head: every depth's
 *     list is extended lazily, on demand, from the one above it.
 *   - The tree is the merge of the D + 1 depth lists, ties going to the shallower depth. A
 *     node is never taken before its parent: until the parent is taken, the parent's list
 *     head scores at least the parent's score, which is at least the child's (q <= 1), and
 *     wins a tie by being shallower.
 *
 * Ties between lists of one merge go to the lower rank (or depth). Scores are float32 sums
 * from the root down, parent + log q, the additions the heap reference makes, so every log score
 * equals its parent's plus log q exactly. Tensors are passed by data address; the GIL is
 * released while the batch is built.
 *
 * Bound on the work: depth d's list is extended only to show the final merge its next node,
 * or to show depth d + 1's merge a head, which is at most one past depth d + 1's length. So
 * with L depths, depth d holds at most n + L - 1 - d nodes.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* One request's depth lists (row d of each [L, cap] table is depth d; depth 0 is the root). */
typedef struct {
    const float *log_q; /* [D, K] this request's log q, each row descending */
    int64_t top_k, cap;
    float *score;       /* [L, cap] log rho, best first within each depth */
    int32_t *parent;    /* [L, cap] the node's position in depth d-1's list */
    int32_t *rank;      /* [L, cap] the rank of its token at depth d */
    int32_t *slot;      /* [L, cap] its output slot once taken */
    int64_t *length;    /* [L] nodes produced so far */
    uint8_t *done;      /* [L] 1 once the depth has no more nodes */
    int64_t *head;      /* [L, K] next depth-(d-1) position each rank's list extends */
    float *head_score;  /* [L, K] the score of that candidate (-inf when exhausted) */
    uint8_t *live;      /* [L, K] 0 once the rank's list is exhausted */
} Lists;

static int ensure(Lists *t, int64_t d, int64_t j);

/* Recompute the candidate at the head of depth d's rank-k list. */
static void set_head(Lists *t, int64_t d, int64_t k) {
    const int64_t at = d * t->top_k + k, i = t->head[at];
    if (ensure(t, d - 1, i)) {
        t->head_score[at] = t->score[(d - 1) * t->cap + i] + t->log_q[(d - 1) * t->top_k + k];
        t->live[at] = 1;
    } else {
        t->head_score[at] = -INFINITY;
        t->live[at] = 0;
    }
}

/* Append depth d's next best node; 0 if the depth has none left. */
static int extend(Lists *t, int64_t d) {
    const int64_t top_k = t->top_k;
    const float *hs = t->head_score + d * top_k;
    const uint8_t *live = t->live + d * top_k;
    int64_t best = 0; /* branch-free scan; ties go to the lower rank */
    for (int64_t k = 1; k < top_k; k++) best = hs[k] > hs[best] ? k : best;
    if (!live[best]) { /* only when every live head scores -inf, or none is left */
        best = 0;
        while (best < top_k && !live[best]) best++;
    }
    if (best == top_k || t->length[d] == t->cap) {
        t->done[d] = 1;
        return 0;
    }
    const int64_t j = d * t->cap + t->length[d]++, at = d * top_k + best;
    t->score[j] = hs[best];
    t->parent[j] = (int32_t)t->head[at]++;
    t->rank[j] = (int32_t)best;
    set_head(t, d, best);
    return 1;
}

/* 1 if depth d's list has a node at position j (producing it if needed), else 0. */
static int ensure(Lists *t, int64_t d, int64_t j) {
    while (t->length[d] <= j) {
        if (t->done[d] || !extend(t, d)) return 0;
    }
    return 1;
}

/* Build one request's tree into its [max_nodes] outputs, best first, then padding; returns
 * the nodes placed (fewer than n only if n exceeds the lattice). */
static int64_t build_one(Lists *t, const int64_t *tokens, int64_t root, int64_t levels, int64_t n,
                      int64_t max_nodes, int64_t *taken, int64_t *out_token,
                      int64_t *out_parent, int64_t *out_depth, float *out_score) {
    const int64_t top_k = t->top_k, cap = t->cap;
    t->score[0] = 0.0f;
    t->length[0] = 1;
    t->done[0] = 1;
    taken[0] = 0;
    for (int64_t d = 1; d < levels; d++) { /* depth d's heads need depth d-1 set up */
        t->length[d] = 0;
        t->done[d] = 0;
        taken[d] = 0;
        for (int64_t k = 0; k < top_k; k++) {
            t->head[d * top_k + k] = 0;
            set_head(t, d, k);
        }
    }
    for (int64_t s = 0; s < n; s++) {
        int64_t best = -1;
        float best_score = 0.0f;
        for (int64_t d = 0; d < levels; d++) { /* ascending: ties go to the shallower */
            if (!ensure(t, d, taken[d])) continue;
            const float score = t->score[d * cap + taken[d]];
            if (best < 0 || score > best_score) {
                best = d;
                best_score = score;
            }
        }
        if (best < 0) return s;
        const int64_t j = best * cap + taken[best]++;
        t->slot[j] = (int32_t)s;
        out_score[s] = best_score;
        out_depth[s] = best;
        out_parent[s] = best == 0 ? -1 : t->slot[(best - 1) * cap + t->parent[j]];
        out_token[s] = best == 0 ? root : tokens[(best - 1) * top_k + t->rank[j]];
    }
    for (int64_t s = n; s < max_nodes; s++) {
        out_score[s] = -INFINITY;
        out_depth[s] = 0;
        out_parent[s] = -1;
        out_token[s] = 0;
    }
    return n;
}

/* build(log_q, tokens, roots, out_token, out_parent, out_depth, out_score,
 *       batch, depth, top_k, n, max_nodes) -> None. The first seven are tensor data
 * addresses: log_q [B, D, K] float32 (each row descending), tokens [B, D, K] int64, roots [B]
 * int64, then the outputs [B, max_nodes]: tokens, parent slots, depths (int64) and log scores
 * (float32). n (1 <= n <= max_nodes) must not exceed the lattice's size. */
static PyObject *build(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "build takes 12 arguments, got %zd", nargs);
        return NULL;
    }
    void *ptr[7];
    int64_t val[5];
    for (Py_ssize_t i = 0; i < 7; i++) ptr[i] = PyLong_AsVoidPtr(args[i]);
    for (Py_ssize_t i = 0; i < 5; i++) val[i] = PyLong_AsLongLong(args[7 + i]);
    if (PyErr_Occurred()) return NULL;
    const float *log_q = ptr[0];
    const int64_t *tokens = ptr[1], *roots = ptr[2];
    int64_t *out_token = ptr[3], *out_parent = ptr[4], *out_depth = ptr[5];
    float *out_score = ptr[6];
    const int64_t batch = val[0], depth = val[1], top_k = val[2], n = val[3], max_nodes = val[4];
    if (batch < 0 || depth < 0 || top_k < 1 || n < 1 || n > max_nodes) {
        PyErr_SetString(PyExc_ValueError, "inconsistent tree sizes");
        return NULL;
    }
    const int64_t levels = (depth < n - 1 ? depth : n - 1) + 1; /* depth >= n holds no node */
    const int64_t cap = n + levels, cells = levels * cap, heads = levels * top_k;
    char *scratch = malloc(cells * (sizeof(float) + 3 * sizeof(int32_t)) +
                           heads * (sizeof(int64_t) + sizeof(float) + 1) +
                           levels * (2 * sizeof(int64_t) + 1));
    if (scratch == NULL) return PyErr_NoMemory();
    Lists t = {.top_k = top_k, .cap = cap};
    t.head = (int64_t *)scratch;
    t.length = t.head + heads;
    int64_t *taken = t.length + levels;
    t.score = (float *)(taken + levels);
    t.head_score = t.score + cells;
    t.parent = (int32_t *)(t.head_score + heads);
    t.rank = t.parent + cells;
    t.slot = t.rank + cells;
    t.live = (uint8_t *)(t.slot + cells);
    t.done = t.live + heads;
    int complete = 1;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t b = 0; b < batch && complete; b++) {
        const int64_t in = b * depth * top_k, out = b * max_nodes;
        t.log_q = log_q + in;
        complete = build_one(&t, tokens + in, roots[b], levels, n, max_nodes, taken,
                             out_token + out, out_parent + out, out_depth + out,
                             out_score + out) == n;
    }
    Py_END_ALLOW_THREADS
    free(scratch);
    if (!complete) {
        PyErr_SetString(PyExc_ValueError, "n exceeds the number of nodes in the top-K lattice");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"build", (PyCFunction)(void (*)(void))build, METH_FASTCALL,
     "Best-first trees of a batch from [B, D, K] log q (tensors passed by data address)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_tree_build_cpu",
    .m_doc = "Best-first trees on CPU by lazy merges of depth lists (see tree_build_cpu.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__tree_build_cpu(void) { return PyModule_Create(&module); }
