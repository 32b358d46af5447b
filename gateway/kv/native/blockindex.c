/* The prefix index's storage: which engine views (a pod's DP rank) hold which token blocks.
 *
 * One writer (the process that applies the pods' KV events) and any number of readers (the gateway's
 * workers) share it: the tables readers need live in memory that is private to one process, or in files
 * that every process of a host maps. Readers never lock and never wait: each entry is written with
 * 8-byte atomic stores in an order that lets a reader tell a whole entry from one being changed.
 *
 * Layout (docs/architecture.md, "Knowing what each pod caches"):
 *
 *   control  (fixed size): a header (the data generation, the views' version, counters), one record per
 *            view (its pod, rank, block size, sequence, counts, its subscriber's counters), and a ring of the
 *            blocks the pods evicted (for readers that keep each pod's free queue: keep-warm)
 *   data     (one generation; grown by writing the next): the block table (own hash -> parent, how many
 *            views hold it, up to four of them) and the pair table ((own hash, view) -> copies per tier,
 *            and how many of the view's held blocks have it as their parent)
 *   private  (the writer's own): per view, its engine hash -> own hash map and the order it stored blocks
 *
 * Tables are open-addressed (linear probing, tombstones) over 64-bit keys; own hashes 0 and 1 mark empty
 * and deleted slots, so hashes are folded away from them (``fold``). A table past 3/4 used is rebuilt, at
 * twice the size when more than 3/8 of it is live: in shared memory, as the next generation's file, which
 * readers map when they see the generation change (the old one stays valid until they let it go).
 *
 * The KV-event wire format (gateway/kv/events.py) is decoded here for the common case (vLLM >= 0.24 and
 * SGLang: a batch of tagged maps); anything else is handed back to Python, which decodes it with msgspec.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define EMPTY 0ULL
#define TOMB 1ULL
#define NO_VIEW16 0xFFFFu
#define HINTS 2
#define CTL_MAGIC 0x4B56475743544C31ULL  /* "KVGWCTL1" */
#define DATA_MAGIC 0x4B56475744415431ULL /* "KVGWDAT1" */
#define VERSION 1

/* Pair values: view (20 bits) | GPU copies (12) | offload copies (12) | held children (20). */
#define V_VIEW(v) ((uint32_t)((v) & 0xFFFFFu))
#define V_GPU(v) ((uint32_t)(((v) >> 20) & 0xFFFu))
#define V_OFF(v) ((uint32_t)(((v) >> 32) & 0xFFFu))
#define V_KIDS(v) ((uint32_t)(((v) >> 44) & 0xFFFFFu))
#define V_MAKE(view, gpu, off, kids) \
    ((uint64_t)(view) | ((uint64_t)(gpu) << 20) | ((uint64_t)(off) << 32) | ((uint64_t)(kids) << 44))
#define MAX_COPIES 0xFFFu
#define MAX_KIDS 0xFFFFFu
#define MAX_VIEW_ID 0xFFFFEu

enum { ST_STORED, ST_REMOVED, ST_CLEARS, ST_UNKNOWN_PARENT, ST_UNKNOWN_REMOVED, ST_REJECTED, ST_EVICTED_FOR_MEMORY,
       ST_COUNT };
#define SUB_COUNTERS 12

typedef struct {
    uint64_t magic;
    uint32_t version, max_views;
    uint64_t generation;     /* the data file in use: <path>.<generation> */
    uint64_t views_version;  /* bumped when a view is added or dropped */
    uint64_t stats[ST_COUNT];
    uint64_t pairs_held;     /* (own, view) pairs with a copy in any tier */
    uint64_t writer_pid;
    uint64_t ring_cap;       /* eviction notes the ring holds (0: none kept) */
    uint64_t ring_head;      /* notes written so far: the next one goes to ring[ring_head % ring_cap] */
    uint64_t offload_held;   /* pairs with a copy in the offload tier (0: lookups need not look there) */
    uint64_t pad[13 - ST_COUNT];
} ctl_t;

typedef struct {
    uint32_t live, rank, block_size, approximate;
    int64_t last_seq;
    uint64_t gpu_blocks;   /* blocks with a GPU copy */
    uint64_t blocks;       /* blocks with a copy in any tier */
    int64_t orphans;       /* GPU blocks whose parent the view does not hold on GPU */
    uint64_t evictions;    /* BlockRemoved blocks */
    uint64_t engine_hashes;
    uint64_t counters[SUB_COUNTERS]; /* its subscriber's, mirrored for readers */
    char pod[304];
} view_t;

/* One block a pod's GPU tier no longer holds (evicted, or its cache cleared). ``seq`` is its place in the
 * ring, and all ones while the writer changes it: a reader trusts a note whose seq reads the same around it. */
typedef struct {
    uint64_t seq;
    uint64_t own;
    uint32_t view, kind;
    uint64_t pad;
} note_t;
_Static_assert(sizeof(note_t) == 32, "a note is 32 bytes");
enum { NOTE_EVICTED = 1, NOTE_CLEARED = 2 };

typedef struct {
    uint64_t magic, generation;
    uint64_t block_cap, block_used, block_live;
    uint64_t pair_cap, pair_used, pair_live;
} data_hdr_t; /* 64 bytes */

typedef struct {
    uint64_t own;
    uint64_t parent;            /* 0: a first block */
    uint32_t gpu_holders;       /* views holding it on GPU (none: the entry goes) */
    uint16_t hint[HINTS];       /* some of them (NO_VIEW16: none) */
} block_t;
_Static_assert(sizeof(block_t) == 24, "a block entry is 24 bytes");

typedef struct {
    uint64_t own;
    uint64_t val;
} pair_t;
_Static_assert(sizeof(pair_t) == 16, "a pair entry is 16 bytes");

typedef struct {
    void *base;
    size_t size;
} region_t;

typedef struct {
    uint64_t *keys, *vals;
    uint64_t cap, used, live;
} emap_t;

typedef struct {
    uint64_t *v;
    size_t len, cap;
} fifo_t;

typedef struct {
    emap_t emap;
    fifo_t order;     /* own hashes in the order their pairs were made (stale entries skipped) */
    uint64_t pairs;   /* pairs of this view, children-only ones included */
    uint64_t root;    /* the namespace root of its model (no LoRA) */
    char *model;
    size_t model_len;
} vpriv_t;

typedef struct {
    PyObject_HEAD
    int writer;
    char *path;               /* shared: the control file; its data files are <path>.<generation> */
    region_t ctl_r, data_r;
    ctl_t *ctl;
    view_t *views;
    note_t *ring;
    data_hdr_t *d;
    block_t *blocks;
    pair_t *pairs;
    uint64_t mapped_gen;
    vpriv_t *priv;            /* writer: one per view id */
    uint32_t *free_ids;
    uint32_t nfree, next_id;
    uint64_t max_blocks_per_view;
    PyObject *notes;          /* apply(): what the eviction listener is told, or NULL */
} BlockIndex;

/* ------------------------------------------------------------------------------------------------ */
/* Atomics and hashing */

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

/* Hashes 0 and 1 mark empty and deleted slots: those two are moved to values no engine or prompt is likely to meet. */
static inline uint64_t fold(uint64_t h) { return h < 2 ? 0x9E3779B97F4A7C15ULL + h : h; }

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

/* The gateway's 64-bit hash of a byte string: its chained block hashes (gateway/kv/hashing.py), namespace
 * roots, engine hashes that come as bytes. Ours, and short enough to restate in Python (tests/kv_reference.py;
 * tests/unit/test_prefix_index.py checks that the two agree): the seed and the length plus one start the state;
 * each little-endian 64-bit word of the data (the last one padded with zero bytes) is xored in, the state
 * multiplied by an odd constant and its high half folded onto its low half; ``mix`` spreads the end state over
 * every bit. Each step is a bijection of the state, so two strings of one length that differ in one word never
 * collide. Not cryptographic: like the engines' own hashes, a key for tables and chains. */
#define HASH_LEN_MUL 0x668824D764650DCFULL
#define HASH_STEP_MUL 0x8DA04B0DAF2D7E6FULL

static inline uint64_t le64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

static uint64_t hash64(const void *data, size_t n, uint64_t seed) {
    const uint8_t *p = data;
    uint64_t h = mix(seed ^ ((uint64_t)(n + 1) * HASH_LEN_MUL));
    for (; n >= 8; p += 8, n -= 8) {
        h = (h ^ le64(p)) * HASH_STEP_MUL;
        h ^= h >> 32;
    }
    if (n > 0) {
        uint8_t tail[8] = {0};
        memcpy(tail, p, n);
        h = (h ^ le64(tail)) * HASH_STEP_MUL;
        h ^= h >> 32;
    }
    return mix(h);
}

/* A key's first slot in a table of ``cap`` (any size: tables grow by half, not double). */
static inline uint64_t slot_of(uint64_t key, uint64_t cap) {
    return (uint64_t)(((unsigned __int128)mix(key) * cap) >> 64);
}

static inline uint64_t pair_key(uint64_t own, uint32_t view) { return own ^ ((uint64_t)view * 0x9E3779B97F4A7C15ULL); }

static inline uint64_t next_slot(uint64_t i, uint64_t cap) { return i + 1 == cap ? 0 : i + 1; }

/* Tables are rebuilt past LOAD_MAX used, to a size where what lives fills LOAD_AFTER of it. */
#define LOAD_MAX 0.8
#define LOAD_AFTER 0.55
#define MIN_CAP 1024

static uint64_t rebuilt_cap(uint64_t live) {
    uint64_t cap = (uint64_t)((double)live / LOAD_AFTER) + 1;
    return cap < MIN_CAP ? MIN_CAP : cap;
}

static inline int too_full(uint64_t used, uint64_t cap) { return (double)used > LOAD_MAX * (double)cap; }

/* ------------------------------------------------------------------------------------------------ */
/* Regions: anonymous memory, or a file every process of the host maps */

static int region_map_fd(region_t *r, int fd, size_t size, int writable) {
    void *base = mmap(NULL, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) return -1;
    r->base = base;
    r->size = size;
    return 0;
}

static int region_anon(region_t *r, size_t size) {
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return -1;
    r->base = base;
    r->size = size;
    return 0;
}

/* Create (or reuse, emptied) a file of ``size`` bytes and map it. */
static int region_file(region_t *r, const char *path, size_t size, int truncate) {
    int fd = open(path, O_RDWR | O_CREAT | (truncate ? O_TRUNC : 0), 0600);
    if (fd < 0) return -1;
    if (ftruncate(fd, (off_t)size) != 0 || region_map_fd(r, fd, size, 1) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    close(fd);
    return 0;
}

static int region_open(region_t *r, const char *path, int writable) {
    int fd = open(path, writable ? O_RDWR : O_RDONLY);
    if (fd < 0) return -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || region_map_fd(r, fd, (size_t)st.st_size, writable) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    close(fd);
    return 0;
}

static void region_close(region_t *r) {
    if (r->base != NULL) munmap(r->base, r->size);
    r->base = NULL;
    r->size = 0;
}

static size_t ctl_size(uint32_t max_views, uint64_t ring) {
    return sizeof(ctl_t) + (size_t)max_views * sizeof(view_t) + (size_t)ring * sizeof(note_t);
}

static void bind_ctl(BlockIndex *self) {
    self->ctl = (ctl_t *)self->ctl_r.base;
    self->views = (view_t *)((char *)self->ctl_r.base + sizeof(ctl_t));
    self->ring = (note_t *)(self->views + self->ctl->max_views);
}

static size_t data_size(uint64_t block_cap, uint64_t pair_cap) {
    return sizeof(data_hdr_t) + block_cap * sizeof(block_t) + pair_cap * sizeof(pair_t);
}

static void bind_data(BlockIndex *self) {
    self->d = (data_hdr_t *)self->data_r.base;
    self->blocks = (block_t *)((char *)self->data_r.base + sizeof(data_hdr_t));
    self->pairs = (pair_t *)((char *)self->blocks + self->d->block_cap * sizeof(block_t));
}

static char *data_path(const char *path, uint64_t generation) {
    size_t n = strlen(path) + 32;
    char *out = PyMem_Malloc(n);
    if (out != NULL) snprintf(out, n, "%s.%llu", path, (unsigned long long)generation);
    return out;
}

/* A new, empty data region of these capacities (the writer's). */
static int new_data(BlockIndex *self, region_t *r, uint64_t generation, uint64_t block_cap, uint64_t pair_cap) {
    size_t size = data_size(block_cap, pair_cap);
    if (self->path == NULL) {
        if (region_anon(r, size) != 0) return -1;
    } else {
        char *p = data_path(self->path, generation);
        if (p == NULL) return -1;
        int rc = region_file(r, p, size, 1);
        PyMem_Free(p);
        if (rc != 0) return -1;
    }
    data_hdr_t *d = (data_hdr_t *)r->base;
    d->magic = DATA_MAGIC;
    d->generation = generation;
    d->block_cap = block_cap;
    d->pair_cap = pair_cap;
    return 0;
}

/* A reader maps the generation the control header names, if it is not the one it maps already. */
static int sync_reader(BlockIndex *self) {
    if (self->writer || self->path == NULL) return 0;
    uint64_t generation = LOAD(&self->ctl->generation);
    if (generation == self->mapped_gen && self->data_r.base != NULL) return 0;
    for (int attempt = 0; attempt < 8; attempt++) {
        char *p = data_path(self->path, generation);
        if (p == NULL) return -1;
        region_t r = {NULL, 0};
        int rc = region_open(&r, p, 0);
        PyMem_Free(p);
        if (rc == 0) {
            data_hdr_t *d = (data_hdr_t *)r.base;
            if (r.size >= sizeof(data_hdr_t) && d->magic == DATA_MAGIC && d->generation == generation &&
                r.size >= data_size(d->block_cap, d->pair_cap)) {
                region_close(&self->data_r);
                self->data_r = r;
                self->mapped_gen = generation;
                bind_data(self);
                return 0;
            }
            region_close(&r);
        }
        /* The writer moved on (or is writing it): read the generation again. */
        generation = LOAD(&self->ctl->generation);
    }
    if (self->data_r.base != NULL) return 0; /* keep reading the old one: it is still whole */
    PyErr_Format(PyExc_OSError, "cannot map the index's data file (generation %llu)", (unsigned long long)generation);
    return -1;
}

/* ------------------------------------------------------------------------------------------------ */
/* Block and pair tables */

static int64_t block_find(BlockIndex *self, uint64_t own) {
    uint64_t cap = self->d->block_cap;
    for (uint64_t i = slot_of(own, cap);; i = next_slot(i, cap)) {
        uint64_t k = LOAD(&self->blocks[i].own);
        if (k == own) return (int64_t)i;
        if (k == EMPTY) return -1;
    }
}

static int64_t pair_find(BlockIndex *self, uint64_t own, uint32_t view) {
    uint64_t cap = self->d->pair_cap;
    for (uint64_t i = slot_of(pair_key(own, view), cap);; i = next_slot(i, cap)) {
        pair_t *p = &self->pairs[i];
        uint64_t k = LOAD(&p->own);
        if (k == EMPTY) return -1;
        if (k == own && V_VIEW(LOAD(&p->val)) == view) return (int64_t)i;
    }
}

/* A reader's view of a pair's value (0: none), consistent with its key. */
static uint64_t pair_value(BlockIndex *self, uint64_t own, uint32_t view) {
    uint64_t cap = self->d->pair_cap;
    for (uint64_t i = slot_of(pair_key(own, view), cap);; i = next_slot(i, cap)) {
        pair_t *p = &self->pairs[i];
        uint64_t k = LOAD(&p->own);
        if (k == EMPTY) return 0;
        if (k == own) {
            uint64_t v = LOAD(&p->val);
            if (V_VIEW(v) == view && LOAD(&p->own) == own) return v;
        }
    }
}

static int grow(BlockIndex *self, uint64_t more_blocks, uint64_t more_pairs);

static int ensure_room(BlockIndex *self, uint64_t blocks, uint64_t pairs) {
    data_hdr_t *d = self->d;
    if (too_full(d->block_used + blocks, d->block_cap) || too_full(d->pair_used + pairs, d->pair_cap))
        return grow(self, blocks, pairs);
    return 0;
}

static uint64_t block_insert(BlockIndex *self, uint64_t own, uint64_t parent) {
    data_hdr_t *d = self->d;
    uint64_t cap = d->block_cap;
    uint64_t i = slot_of(own, cap);
    int64_t tomb = -1;
    for (;; i = next_slot(i, cap)) {
        uint64_t k = self->blocks[i].own;
        if (k == EMPTY) break;
        if (k == TOMB && tomb < 0) tomb = (int64_t)i;
    }
    if (tomb >= 0) i = (uint64_t)tomb;
    else d->block_used++;
    block_t *b = &self->blocks[i];
    b->parent = parent;
    STORE(&b->gpu_holders, 0);
    for (int h = 0; h < HINTS; h++) STORE(&b->hint[h], NO_VIEW16);
    STORE(&b->own, own);
    d->block_live++;
    return i;
}

static void block_delete(BlockIndex *self, uint64_t i) {
    STORE(&self->blocks[i].own, TOMB);
    self->d->block_live--;
}

static uint64_t pair_insert(BlockIndex *self, uint64_t own, uint32_t view) {
    data_hdr_t *d = self->d;
    uint64_t cap = d->pair_cap;
    uint64_t i = slot_of(pair_key(own, view), cap);
    int64_t tomb = -1;
    for (;; i = next_slot(i, cap)) {
        uint64_t k = self->pairs[i].own;
        if (k == EMPTY) break;
        if (k == TOMB && tomb < 0) tomb = (int64_t)i;
    }
    if (tomb >= 0) i = (uint64_t)tomb;
    else d->pair_used++;
    STORE(&self->pairs[i].val, V_MAKE(view, 0, 0, 0));
    STORE(&self->pairs[i].own, own);
    d->pair_live++;
    return i;
}

static void pair_delete(BlockIndex *self, uint64_t i) {
    STORE(&self->pairs[i].own, TOMB);
    self->d->pair_live--;
}

/* Rebuild the data region with room for ``more`` entries, dropping tombstones: a new generation. */
static int grow(BlockIndex *self, uint64_t more_blocks, uint64_t more_pairs) {
    data_hdr_t *old = self->d;
    uint64_t block_cap = rebuilt_cap(old->block_live + more_blocks), pair_cap = rebuilt_cap(old->pair_live + more_pairs);
    uint64_t generation = old->generation + 1;
    region_t r = {NULL, 0};
    if (new_data(self, &r, generation, block_cap, pair_cap) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    region_t was = self->data_r;
    block_t *ob = self->blocks;
    pair_t *op = self->pairs;
    uint64_t ob_cap = old->block_cap, op_cap = old->pair_cap;
    self->data_r = r;
    bind_data(self);
    for (uint64_t i = 0; i < ob_cap; i++) {
        if (ob[i].own > TOMB) {
            uint64_t j = block_insert(self, ob[i].own, ob[i].parent);
            block_t *b = &self->blocks[j];
            b->gpu_holders = ob[i].gpu_holders;
            memcpy(b->hint, ob[i].hint, sizeof(b->hint));
        }
    }
    for (uint64_t i = 0; i < op_cap; i++) {
        if (op[i].own > TOMB) {
            uint64_t j = pair_insert(self, op[i].own, V_VIEW(op[i].val));
            self->pairs[j].val = op[i].val;
        }
    }
    self->mapped_gen = generation;
    if (self->ctl != NULL) STORE(&self->ctl->generation, generation);
    region_close(&was);
    if (self->path != NULL) {
        /* Readers still mapping it keep it until they move on; its name is no longer needed. */
        char *p = data_path(self->path, generation - 1);
        if (p != NULL) {
            unlink(p);
            PyMem_Free(p);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* The writer's private maps */

static int emap_init(emap_t *m, uint64_t cap) {
    m->keys = PyMem_Calloc(cap, sizeof(uint64_t));
    m->vals = PyMem_Malloc(cap * sizeof(uint64_t));
    if (m->keys == NULL || m->vals == NULL) {
        PyMem_Free(m->keys);
        PyMem_Free(m->vals);
        m->keys = m->vals = NULL;
        return -1;
    }
    m->cap = cap;
    m->used = m->live = 0;
    return 0;
}

static void emap_free(emap_t *m) {
    PyMem_Free(m->keys);
    PyMem_Free(m->vals);
    m->keys = m->vals = NULL;
    m->cap = m->used = m->live = 0;
}

static int64_t emap_find(const emap_t *m, uint64_t key) {
    if (m->cap == 0) return -1;
    uint64_t cap = m->cap;
    for (uint64_t i = slot_of(key, cap);; i = next_slot(i, cap)) {
        if (m->keys[i] == key) return (int64_t)i;
        if (m->keys[i] == EMPTY) return -1;
    }
}

static int emap_put(emap_t *m, uint64_t key, uint64_t val);

static int emap_rebuild(emap_t *m, uint64_t cap) {
    emap_t old = *m;
    if (emap_init(m, cap) != 0) {
        *m = old;
        return -1;
    }
    for (uint64_t i = 0; i < old.cap; i++)
        if (old.keys[i] > TOMB) emap_put(m, old.keys[i], old.vals[i]);
    emap_free(&old);
    return 0;
}

static int emap_put(emap_t *m, uint64_t key, uint64_t val) {
    if (m->cap == 0 && emap_init(m, 64) != 0) return -1;
    if (too_full(m->used + 1, m->cap)) {
        uint64_t cap = (uint64_t)((double)(m->live + 1) / LOAD_AFTER) + 1;
        if (emap_rebuild(m, cap < 64 ? 64 : cap) != 0) return -1;
    }
    uint64_t cap = m->cap;
    int64_t tomb = -1;
    uint64_t i = slot_of(key, cap);
    for (;; i = next_slot(i, cap)) {
        uint64_t k = m->keys[i];
        if (k == key) {
            m->vals[i] = val;
            return 0;
        }
        if (k == EMPTY) break;
        if (k == TOMB && tomb < 0) tomb = (int64_t)i;
    }
    if (tomb >= 0) i = (uint64_t)tomb;
    else m->used++;
    m->keys[i] = key;
    m->vals[i] = val;
    m->live++;
    return 0;
}

static void emap_del(emap_t *m, uint64_t key) {
    int64_t i = emap_find(m, key);
    if (i >= 0) {
        m->keys[i] = TOMB;
        m->live--;
    }
}

static int order_push(fifo_t *f, uint64_t own) {
    if (f->len == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 64;
        uint64_t *v = PyMem_Realloc(f->v, cap * sizeof(uint64_t));
        if (v == NULL) return -1;
        f->v = v;
        f->cap = cap;
    }
    f->v[f->len++] = own;
    return 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* Views */

static int check_view(BlockIndex *self, long view) {
    if (view < 0 || (uint64_t)view >= self->ctl->max_views || !LOAD(&self->views[view].live)) {
        PyErr_Format(PyExc_KeyError, "no view %ld", view);
        return -1;
    }
    return 0;
}

static int check_writer(BlockIndex *self) {
    if (!self->writer) {
        PyErr_SetString(PyExc_PermissionError, "this handle only reads the index");
        return -1;
    }
    return 0;
}

static void hint_add(block_t *b, uint32_t view) {
    if (view >= NO_VIEW16) return;
    for (int h = 0; h < HINTS; h++)
        if (b->hint[h] == NO_VIEW16) {
            STORE(&b->hint[h], (uint16_t)view);
            return;
        }
    STORE(&b->hint[b->gpu_holders % HINTS], (uint16_t)view);
}

/* A view no longer holds the block on GPU: the entry goes with its last holder. */
static void block_released(BlockIndex *self, uint64_t i, uint32_t view) {
    block_t *b = &self->blocks[i];
    for (int h = 0; h < HINTS; h++)
        if (b->hint[h] == view) STORE(&b->hint[h], NO_VIEW16);
    STORE(&b->gpu_holders, b->gpu_holders - 1);
    if (!b->gpu_holders) block_delete(self, i);
}

/* The pair (own, view), made if missing (its slot; -1 on error). */
static int64_t pair_get(BlockIndex *self, uint64_t own, uint32_t view) {
    int64_t i = pair_find(self, own, view);
    if (i >= 0) return i;
    if (ensure_room(self, 1, 1) != 0) return -1;
    uint64_t j = pair_insert(self, own, view);
    vpriv_t *p = &self->priv[view];
    p->pairs++;
    if (order_push(&p->order, own) != 0) {
        PyErr_NoMemory();
        return -1;
    }
    return (int64_t)j;
}

static void pair_set(BlockIndex *self, uint64_t i, uint64_t val) { STORE(&self->pairs[i].val, val); }

/* A pair with no copy and no held children goes. */
static void pair_maybe_drop(BlockIndex *self, uint64_t i) {
    uint64_t v = self->pairs[i].val;
    if (V_GPU(v) == 0 && V_OFF(v) == 0 && V_KIDS(v) == 0) {
        self->priv[V_VIEW(v)].pairs--;
        pair_delete(self, i);
    }
}

/* ``own`` (child of ``parent``; 0: a first block) is now held on the view's GPU tier. */
static int gpu_held(BlockIndex *self, uint32_t view, uint64_t own, uint64_t parent) {
    view_t *vr = &self->views[view];
    vr->gpu_blocks++;
    if (parent) {
        int64_t pi = pair_get(self, parent, view);
        if (pi < 0) return -1;
        uint64_t pv = self->pairs[pi].val;
        uint32_t kids = V_KIDS(pv);
        if (kids < MAX_KIDS) pair_set(self, (uint64_t)pi, V_MAKE(view, V_GPU(pv), V_OFF(pv), kids + 1));
        if (!V_GPU(pv)) vr->orphans++;
    }
    int64_t oi = pair_find(self, own, view);
    if (oi >= 0) vr->orphans -= V_KIDS(self->pairs[oi].val);
    return 0;
}

/* ``own`` is no longer on the view's GPU tier (its pair already says so). */
static void gpu_released(BlockIndex *self, uint32_t view, uint64_t own, uint64_t parent) {
    view_t *vr = &self->views[view];
    vr->gpu_blocks--;
    int64_t oi = pair_find(self, own, view);
    if (oi >= 0) vr->orphans += V_KIDS(self->pairs[oi].val);
    if (parent) {
        int64_t pi = pair_find(self, parent, view);
        if (pi >= 0) {
            uint64_t pv = self->pairs[pi].val;
            uint32_t kids = V_KIDS(pv);
            pair_set(self, (uint64_t)pi, V_MAKE(view, V_GPU(pv), V_OFF(pv), kids ? kids - 1 : 0));
            if (!V_GPU(pv)) vr->orphans--;
            pair_maybe_drop(self, (uint64_t)pi);
        }
    }
}

static int note(BlockIndex *self, const char *kind, PyObject *owns) {
    if (self->notes == NULL) return 0;
    PyObject *item = Py_BuildValue("(sO)", kind, owns);
    if (item == NULL) return -1;
    int rc = PyList_Append(self->notes, item);
    Py_DECREF(item);
    return rc;
}

/* Store one block copy (own, child of parent) on a tier. */
static int store_one(BlockIndex *self, uint32_t view, uint64_t ehash, uint64_t own, uint64_t parent, int offload) {
    vpriv_t *p = &self->priv[view];
    if (emap_put(&p->emap, ehash, own) != 0) {
        PyErr_NoMemory();
        return -1;
    }
    if (ensure_room(self, 2, 2) != 0) return -1;
    int64_t i = pair_get(self, own, view);
    if (i < 0) return -1;
    uint64_t v = self->pairs[i].val;
    uint32_t gpu = V_GPU(v), off = V_OFF(v);
    view_t *vr = &self->views[view];
    if (!gpu && !off) {
        vr->blocks++;
        __atomic_add_fetch(&self->ctl->pairs_held, 1, __ATOMIC_RELAXED);
    }
    if (offload) {
        pair_set(self, (uint64_t)i, V_MAKE(view, gpu, off < MAX_COPIES ? off + 1 : off, V_KIDS(v)));
        if (!off) __atomic_add_fetch(&self->ctl->offload_held, 1, __ATOMIC_RELAXED);
    } else {
        pair_set(self, (uint64_t)i, V_MAKE(view, gpu < MAX_COPIES ? gpu + 1 : gpu, off, V_KIDS(v)));
        if (!gpu) {
            int64_t bi = block_find(self, own);
            if (bi < 0) bi = (int64_t)block_insert(self, own, parent);
            block_t *b = &self->blocks[bi];
            hint_add(b, view);
            STORE(&b->gpu_holders, b->gpu_holders + 1);
            if (gpu_held(self, view, own, parent) != 0) return -1;
        }
    }
    vr->engine_hashes = p->emap.live;
    return 0;
}

/* A block the view's GPU tier no longer holds: into the ring (when kept) and the caller's list (when given). */
static int note_own(BlockIndex *self, uint32_t view, uint32_t kind, uint64_t own, PyObject *list) {
    uint64_t cap = self->ctl->ring_cap;
    if (cap) {
        uint64_t seq = self->ctl->ring_head;
        note_t *n = &self->ring[seq % cap];
        STORE(&n->seq, ~0ULL);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        n->own = own;
        n->view = view;
        n->kind = kind;
        STORE(&n->seq, seq);
        STORE(&self->ctl->ring_head, seq + 1);
    }
    if (list == NULL) return 0;
    PyObject *o = PyLong_FromUnsignedLongLong(own);
    if (o == NULL || PyList_Append(list, o) != 0) {
        Py_XDECREF(o);
        return -1;
    }
    Py_DECREF(o);
    return 0;
}

/* The pair at slot i loses every copy it has (shrinking, resetting): the block's counts follow. */
static int drop_copies(BlockIndex *self, uint32_t view, uint64_t own, int notify, PyObject *gone) {
    int64_t i = pair_find(self, own, view);
    if (i < 0) return 0;
    uint64_t v = self->pairs[i].val;
    uint32_t gpu = V_GPU(v), off = V_OFF(v);
    if (!gpu && !off) return 0;
    int64_t bi = block_find(self, own);
    uint64_t parent = bi >= 0 ? self->blocks[bi].parent : 0;
    pair_set(self, (uint64_t)i, V_MAKE(view, 0, 0, V_KIDS(v)));
    if (off) __atomic_sub_fetch(&self->ctl->offload_held, 1, __ATOMIC_RELAXED);
    view_t *vr = &self->views[view];
    if (gpu) {
        if (bi >= 0) block_released(self, (uint64_t)bi, view);
        gpu_released(self, view, own, parent);
        if (notify && note_own(self, view, NOTE_CLEARED, own, gone) != 0) return -1;
    }
    vr->blocks--;
    __atomic_sub_fetch(&self->ctl->pairs_held, 1, __ATOMIC_RELAXED);
    i = pair_find(self, own, view);
    if (i >= 0) pair_maybe_drop(self, (uint64_t)i);
    return 0;
}

/* Remove one copy by its engine hash; 1 if it was the last GPU copy (evicted), 0 if not, -1 on error,
 * 2 if the engine hash names nothing held on that tier. */
static int remove_one(BlockIndex *self, uint32_t view, uint64_t ehash, int offload, uint64_t *own_out) {
    vpriv_t *p = &self->priv[view];
    int64_t e = emap_find(&p->emap, ehash);
    if (e < 0) return 2;
    uint64_t own = p->emap.vals[e];
    int64_t i = pair_find(self, own, view);
    if (i < 0) return 2;
    uint64_t v = self->pairs[i].val;
    uint32_t gpu = V_GPU(v), off = V_OFF(v);
    if (offload ? !off : !gpu) return 2;
    view_t *vr = &self->views[view];
    int evicted = 0;
    if (offload) {
        if (!--off) __atomic_sub_fetch(&self->ctl->offload_held, 1, __ATOMIC_RELAXED);
    } else {
        gpu--;
    }
    pair_set(self, (uint64_t)i, V_MAKE(view, gpu, off, V_KIDS(v)));
    if (!offload && !gpu) {
        int64_t bi = block_find(self, own);
        uint64_t parent = bi >= 0 ? self->blocks[bi].parent : 0;
        if (bi >= 0) block_released(self, (uint64_t)bi, view);
        gpu_released(self, view, own, parent);
        evicted = 1;
    }
    if (!gpu && !off) {
        /* No copy left: the engine hash is forgotten (an event naming it later is an unknown parent). */
        emap_del(&p->emap, ehash);
        vr->engine_hashes = p->emap.live;
        vr->blocks--;
        __atomic_sub_fetch(&self->ctl->pairs_held, 1, __ATOMIC_RELAXED);
        i = pair_find(self, own, view);
        if (i >= 0) pair_maybe_drop(self, (uint64_t)i);
    }
    vr->evictions++;
    *own_out = own;
    return evicted;
}

/* Forget every block of the view (its GPU ones noted when ``notify``, and listed in ``gone`` when given). */
static int clear_view(BlockIndex *self, uint32_t view, int notify, PyObject *gone) {
    vpriv_t *p = &self->priv[view];
    for (size_t k = 0; k < p->order.len; k++) {
        uint64_t own = p->order.v[k];
        if (drop_copies(self, view, own, notify, gone) != 0) return -1;
        int64_t i = pair_find(self, own, view);
        if (i >= 0) {
            p->pairs--;
            pair_delete(self, (uint64_t)i);
        }
    }
    p->order.len = 0;
    p->pairs = 0;
    emap_free(&p->emap);
    view_t *vr = &self->views[view];
    vr->gpu_blocks = vr->blocks = vr->engine_hashes = 0;
    vr->orphans = 0;
    vr->approximate = 0;
    return 0;
}

/* Past the memory bound, forget the blocks the view stored first, down to 9/10 of it. */
static int shrink(BlockIndex *self, uint32_t view) {
    vpriv_t *p = &self->priv[view];
    view_t *vr = &self->views[view];
    uint64_t keep = self->max_blocks_per_view * 9 / 10;
    size_t k = 0, n = p->order.len;
    fifo_t kept = {NULL, 0, 0};
    for (; k < n && vr->blocks > keep; k++) {
        uint64_t own = p->order.v[k];
        int64_t i = pair_find(self, own, view);
        if (i < 0) continue;
        uint64_t v = self->pairs[i].val;
        if (!V_GPU(v) && !V_OFF(v)) {
            if (order_push(&kept, own) != 0) goto nomem; /* only a parent of held blocks: it stays */
            continue;
        }
        if (drop_copies(self, view, own, 0, NULL) != 0) goto fail;
        self->ctl->stats[ST_EVICTED_FOR_MEMORY]++;
        if (pair_find(self, own, view) >= 0 && order_push(&kept, own) != 0) goto nomem;
    }
    /* What is left of the order, after the entries kept. */
    for (; k < n; k++)
        if (order_push(&kept, p->order.v[k]) != 0) goto nomem;
    PyMem_Free(p->order.v);
    p->order = kept;
    /* Engine hashes of forgotten blocks: dropped once they are half the map. */
    if (p->emap.live > 2 * vr->blocks + 1024) {
        emap_t *m = &p->emap;
        for (uint64_t i = 0; i < m->cap; i++)
            if (m->keys[i] > TOMB && pair_find(self, m->vals[i], view) < 0) {
                m->keys[i] = TOMB;
                m->live--;
            }
        vr->engine_hashes = m->live;
    }
    return 0;
nomem:
    PyErr_NoMemory();
fail:
    PyMem_Free(kept.v);
    return -1;
}

/* The order keeps stale entries (removed pairs, the same block stored again): compacted past 1.5 times the pairs. */
static int compact_order(BlockIndex *self, uint32_t view) {
    vpriv_t *p = &self->priv[view];
    if (p->order.len <= p->pairs + p->pairs / 2 + 1024) return 0;
    emap_t seen = {NULL, NULL, 0, 0, 0};
    size_t out = 0;
    for (size_t k = 0; k < p->order.len; k++) {
        uint64_t own = p->order.v[k];
        if (pair_find(self, own, view) < 0 || emap_find(&seen, own) >= 0) continue;
        if (emap_put(&seen, own, 1) != 0) {
            emap_free(&seen);
            PyErr_NoMemory();
            return -1;
        }
        p->order.v[out++] = own;
    }
    p->order.len = out;
    emap_free(&seen);
    return 0;
}

static int after_store(BlockIndex *self, uint32_t view) {
    if (self->views[view].blocks > self->max_blocks_per_view && shrink(self, view) != 0) return -1;
    return compact_order(self, view);
}

/* ------------------------------------------------------------------------------------------------ */
/* msgpack, as much of it as event batches use */

typedef struct {
    const uint8_t *p, *end;
} mp_t;

static inline int mp_need(mp_t *m, size_t n) { return (size_t)(m->end - m->p) >= n; }

static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* An integer: 1 and its value (two's complement for negatives), 0 if the next item is no integer. */
static int mp_int(mp_t *m, uint64_t *out, int *negative) {
    if (!mp_need(m, 1)) return 0;
    uint8_t t = *m->p;
    *negative = 0;
    if (t <= 0x7f) { *out = t; m->p++; return 1; }
    if (t >= 0xe0) { *out = (uint64_t)(int64_t)(int8_t)t; *negative = 1; m->p++; return 1; }
    int n;
    int sign;
    switch (t) {
        case 0xcc: n = 1; sign = 0; break;
        case 0xcd: n = 2; sign = 0; break;
        case 0xce: n = 4; sign = 0; break;
        case 0xcf: n = 8; sign = 0; break;
        case 0xd0: n = 1; sign = 1; break;
        case 0xd1: n = 2; sign = 1; break;
        case 0xd2: n = 4; sign = 1; break;
        case 0xd3: n = 8; sign = 1; break;
        default: return 0;
    }
    if (!mp_need(m, 1 + (size_t)n)) return 0;
    uint64_t v = be(m->p + 1, n);
    if (sign && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~0ULL << (8 * n);
    if (sign && (int64_t)v < 0) *negative = 1;
    *out = v;
    m->p += 1 + n;
    return 1;
}

static int mp_nil(mp_t *m) {
    if (mp_need(m, 1) && *m->p == 0xc0) { m->p++; return 1; }
    return 0;
}

static int mp_array(mp_t *m, uint32_t *n) {
    if (!mp_need(m, 1)) return 0;
    uint8_t t = *m->p;
    if ((t & 0xf0) == 0x90) { *n = t & 0x0f; m->p++; return 1; }
    if (t == 0xdc && mp_need(m, 3)) { *n = (uint32_t)be(m->p + 1, 2); m->p += 3; return 1; }
    if (t == 0xdd && mp_need(m, 5)) { *n = (uint32_t)be(m->p + 1, 4); m->p += 5; return 1; }
    return 0;
}

static int mp_map(mp_t *m, uint32_t *n) {
    if (!mp_need(m, 1)) return 0;
    uint8_t t = *m->p;
    if ((t & 0xf0) == 0x80) { *n = t & 0x0f; m->p++; return 1; }
    if (t == 0xde && mp_need(m, 3)) { *n = (uint32_t)be(m->p + 1, 2); m->p += 3; return 1; }
    if (t == 0xdf && mp_need(m, 5)) { *n = (uint32_t)be(m->p + 1, 4); m->p += 5; return 1; }
    return 0;
}

/* A str (or, with ``bin``, a bin): 1 and its bytes, 0 if the next item is not one. */
static int mp_bytes(mp_t *m, int bin, const uint8_t **s, uint32_t *len) {
    if (!mp_need(m, 1)) return 0;
    uint8_t t = *m->p;
    size_t head;
    uint32_t n;
    if (!bin && (t & 0xe0) == 0xa0) { head = 1; n = t & 0x1f; }
    else if ((!bin && t == 0xd9) || (bin && t == 0xc4)) { if (!mp_need(m, 2)) return 0; head = 2; n = m->p[1]; }
    else if ((!bin && t == 0xda) || (bin && t == 0xc5)) { if (!mp_need(m, 3)) return 0; head = 3; n = (uint32_t)be(m->p + 1, 2); }
    else if ((!bin && t == 0xdb) || (bin && t == 0xc6)) { if (!mp_need(m, 5)) return 0; head = 5; n = (uint32_t)be(m->p + 1, 4); }
    else return 0;
    if (!mp_need(m, head + n)) return 0;
    *s = m->p + head;
    *len = n;
    m->p += head + n;
    return 1;
}

static int mp_skip(mp_t *m, int depth) {
    if (depth > 32 || !mp_need(m, 1)) return 0;
    uint8_t t = *m->p;
    uint64_t v;
    int neg;
    const uint8_t *s;
    uint32_t n;
    if (mp_int(m, &v, &neg) || mp_nil(m)) return 1;
    if (t == 0xc2 || t == 0xc3) { m->p++; return 1; }
    if (t == 0xca) { if (!mp_need(m, 5)) return 0; m->p += 5; return 1; }
    if (t == 0xcb) { if (!mp_need(m, 9)) return 0; m->p += 9; return 1; }
    if (mp_bytes(m, 0, &s, &n) || mp_bytes(m, 1, &s, &n)) return 1;
    if (mp_array(m, &n)) {
        for (uint32_t i = 0; i < n; i++)
            if (!mp_skip(m, depth + 1)) return 0;
        return 1;
    }
    if (mp_map(m, &n)) {
        for (uint32_t i = 0; i < 2 * n; i++)
            if (!mp_skip(m, depth + 1)) return 0;
        return 1;
    }
    return 0; /* ext types and reserved bytes: not an event batch this decoder reads */
}

static int mp_number(mp_t *m) {
    uint64_t v;
    int neg;
    if (mp_int(m, &v, &neg)) return 1;
    if (mp_need(m, 5) && *m->p == 0xca) { m->p += 5; return 1; }
    if (mp_need(m, 9) && *m->p == 0xcb) { m->p += 9; return 1; }
    return 0;
}

/* An engine hash (int or bytes), as the index keys it. */
static int mp_hash(mp_t *m, uint64_t *out) {
    int neg;
    const uint8_t *s;
    uint32_t n;
    if (mp_int(m, out, &neg)) { *out = fold(*out); return 1; }
    if (mp_bytes(m, 1, &s, &n)) { *out = fold(hash64(s, n, 0)); return 1; }
    return 0;
}

enum { EV_STORED = 1, EV_REMOVED, EV_CLEARED };

typedef struct {
    int kind;
    mp_t hashes;
    uint32_t nhashes;
    int has_parent;
    uint64_t parent;
    mp_t tokens;
    uint32_t ntokens;
    int bad_token;
    int64_t block_size;
    int have_bs, have_hashes, have_parent_field, have_tokens;
    int offload;
    const uint8_t *lora;
    uint32_t lora_len;
    int lookahead;
} ev_t;

static int key_is(const uint8_t *s, uint32_t n, const char *k) { return strlen(k) == n && memcmp(s, k, n) == 0; }

/* One event map; 0 when the batch must go to the Python decoder. */
static int parse_event(mp_t *m, ev_t *ev) {
    uint32_t fields;
    memset(ev, 0, sizeof(*ev));
    if (!mp_map(m, &fields)) return 0;
    for (uint32_t f = 0; f < fields; f++) {
        const uint8_t *k;
        uint32_t klen;
        if (!mp_bytes(m, 0, &k, &klen)) return 0;
        if (key_is(k, klen, "type")) {
            const uint8_t *s;
            uint32_t n;
            if (!mp_bytes(m, 0, &s, &n)) return 0;
            if (key_is(s, n, "BlockStored")) ev->kind = EV_STORED;
            else if (key_is(s, n, "BlockRemoved")) ev->kind = EV_REMOVED;
            else if (key_is(s, n, "AllBlocksCleared")) ev->kind = EV_CLEARED;
            else return 0;
        } else if (key_is(k, klen, "block_hashes")) {
            if (!mp_array(m, &ev->nhashes)) return 0;
            ev->hashes = *m;
            for (uint32_t i = 0; i < ev->nhashes; i++) {
                uint64_t h;
                if (!mp_hash(m, &h)) return 0;
            }
            ev->have_hashes = 1;
        } else if (key_is(k, klen, "parent_block_hash")) {
            ev->have_parent_field = 1;
            if (!mp_nil(m)) {
                if (!mp_hash(m, &ev->parent)) return 0;
                ev->has_parent = 1;
            }
        } else if (key_is(k, klen, "token_ids")) {
            if (!mp_array(m, &ev->ntokens)) return 0;
            ev->tokens = *m;
            for (uint32_t i = 0; i < ev->ntokens; i++) {
                uint64_t t;
                int neg;
                if (!mp_int(m, &t, &neg)) return 0;
                if (neg || t > 0xFFFFFFFFULL) ev->bad_token = 1;
            }
            ev->have_tokens = 1;
        } else if (key_is(k, klen, "block_size")) {
            uint64_t v;
            int neg;
            if (!mp_int(m, &v, &neg)) return 0;
            ev->block_size = (int64_t)v;
            ev->have_bs = 1;
        } else if (key_is(k, klen, "medium")) {
            const uint8_t *s;
            uint32_t n;
            if (mp_nil(m)) ev->offload = 0;
            else if (mp_bytes(m, 0, &s, &n)) ev->offload = !(key_is(s, n, "GPU") || key_is(s, n, "gpu"));
            else return 0;
        } else if (key_is(k, klen, "lora_name")) {
            if (!mp_nil(m)) {
                if (!mp_bytes(m, 0, &ev->lora, &ev->lora_len)) return 0;
            }
        } else if (key_is(k, klen, "lora_id")) {
            uint64_t v;
            int neg;
            if (!mp_nil(m) && !mp_int(m, &v, &neg)) return 0;
        } else if (key_is(k, klen, "extra_keys")) {
            uint32_t n;
            if (mp_nil(m)) continue;
            if (!mp_array(m, &n)) return 0;
            for (uint32_t i = 0; i < n; i++)
                if (!mp_nil(m)) return 0; /* extra keys hash as Python writes them: the Python path */
        } else if (key_is(k, klen, "lookahead_token_ids")) {
            uint32_t n;
            if (mp_nil(m)) continue;
            if (!mp_array(m, &n)) return 0;
            for (uint32_t i = 0; i < n; i++) {
                uint64_t t;
                int neg;
                if (!mp_int(m, &t, &neg)) return 0;
            }
            ev->lookahead = n > 0;
        } else if (!mp_skip(m, 0)) {
            return 0;
        }
    }
    if (ev->kind == EV_STORED)
        return ev->have_hashes && ev->have_parent_field && ev->have_tokens && ev->have_bs;
    if (ev->kind == EV_REMOVED) return ev->have_hashes;
    return ev->kind == EV_CLEARED;
}

/* ------------------------------------------------------------------------------------------------ */
/* Applying decoded events */

static uint64_t root_of(BlockIndex *self, uint32_t view, const uint8_t *lora, uint32_t lora_len) {
    vpriv_t *p = &self->priv[view];
    if (lora == NULL || lora_len == 0) return p->root;
    size_t n = p->model_len + 1 + lora_len;
    char small[512];
    char *buf = n <= sizeof(small) ? small : PyMem_Malloc(n);
    if (buf == NULL) return p->root;
    memcpy(buf, p->model, p->model_len);
    buf[p->model_len] = 0;
    memcpy(buf + p->model_len + 1, lora, lora_len);
    uint64_t root = hash64(buf, n, 0);
    if (buf != small) PyMem_Free(buf);
    return root;
}

static int apply_stored(BlockIndex *self, uint32_t view, ev_t *ev) {
    uint64_t *stats = self->ctl->stats;
    int64_t bs = ev->block_size;
    if (ev->lookahead || bs <= 0 || (uint64_t)ev->ntokens != (uint64_t)ev->nhashes * (uint64_t)bs) {
        stats[ST_REJECTED]++;
        return 0;
    }
    self->views[view].block_size = (uint32_t)bs;
    uint64_t parent_own = 0, seed;
    if (ev->has_parent) {
        int64_t e = emap_find(&self->priv[view].emap, ev->parent);
        if (e < 0) {
            stats[ST_UNKNOWN_PARENT]++;
            return 0;
        }
        parent_own = seed = self->priv[view].emap.vals[e];
    } else {
        seed = root_of(self, view, ev->lora, ev->lora_len);
    }
    if (ev->bad_token) {
        stats[ST_REJECTED]++;
        return 0;
    }
    uint32_t small[1024];
    uint32_t *buf = (size_t)bs <= 1024 ? small : PyMem_Malloc((size_t)bs * 4);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    mp_t hashes = ev->hashes, tokens = ev->tokens;
    int rc = 0;
    for (uint32_t b = 0; b < ev->nhashes && rc == 0; b++) {
        for (int64_t t = 0; t < bs; t++) {
            uint64_t v;
            int neg;
            mp_int(&tokens, &v, &neg);
            buf[t] = (uint32_t)v;
        }
        uint64_t raw = hash64(buf, (size_t)bs * 4, seed), own = fold(raw);
        uint64_t ehash;
        mp_hash(&hashes, &ehash);
        rc = store_one(self, view, ehash, own, parent_own, ev->offload);
        parent_own = own;
        seed = raw;
    }
    if (buf != small) PyMem_Free(buf);
    if (rc != 0) return -1;
    stats[ST_STORED] += ev->nhashes;
    return after_store(self, view);
}

static int apply_removed(BlockIndex *self, uint32_t view, ev_t *ev) {
    PyObject *evicted = self->notes != NULL ? PyList_New(0) : NULL;
    if (self->notes != NULL && evicted == NULL) return -1;
    mp_t hashes = ev->hashes;
    int rc = 0;
    for (uint32_t i = 0; i < ev->nhashes; i++) {
        uint64_t ehash, own;
        mp_hash(&hashes, &ehash);
        int r = remove_one(self, view, ehash, ev->offload, &own);
        if (r == 2) {
            self->ctl->stats[ST_UNKNOWN_REMOVED]++;
            continue;
        }
        self->ctl->stats[ST_REMOVED]++;
        if (r == 1 && note_own(self, view, NOTE_EVICTED, own, evicted) != 0) {
            rc = -1;
            break;
        }
    }
    if (rc == 0 && evicted != NULL && PyList_GET_SIZE(evicted) > 0) rc = note(self, "evicted", evicted);
    Py_XDECREF(evicted);
    return rc;
}

static int apply_cleared(BlockIndex *self, uint32_t view) {
    self->ctl->stats[ST_CLEARS]++;
    PyObject *gone = self->notes != NULL ? PyList_New(0) : NULL;
    if (self->notes != NULL && gone == NULL) return -1;
    int rc = clear_view(self, view, 1, gone);
    if (rc == 0 && gone != NULL) rc = note(self, "cleared", gone);
    Py_XDECREF(gone);
    return rc;
}

/* ------------------------------------------------------------------------------------------------ */
/* Python type */

static PyObject *u64(uint64_t v) { return PyLong_FromUnsignedLongLong(v); }

static int as_hash(PyObject *o, uint64_t *out) {
    if (PyLong_Check(o)) {
        uint64_t v = PyLong_AsUnsignedLongLongMask(o);
        if (v == (uint64_t)-1 && PyErr_Occurred()) return -1;
        *out = fold(v);
        return 0;
    }
    if (PyBytes_Check(o)) {
        *out = fold(hash64(PyBytes_AS_STRING(o), (size_t)PyBytes_GET_SIZE(o), 0));
        return 0;
    }
    PyErr_SetString(PyExc_TypeError, "a block hash is an int or bytes");
    return -1;
}

static void BlockIndex_dealloc(BlockIndex *self) {
    if (self->priv != NULL && self->ctl != NULL) {
        for (uint32_t v = 0; v < self->ctl->max_views; v++) {
            emap_free(&self->priv[v].emap);
            PyMem_Free(self->priv[v].order.v);
            PyMem_Free(self->priv[v].model);
        }
    }
    PyMem_Free(self->priv);
    PyMem_Free(self->free_ids);
    region_close(&self->data_r);
    region_close(&self->ctl_r);
    PyMem_Free(self->path);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int BlockIndex_init(BlockIndex *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "writer", "max_views", "max_blocks_per_view", "ring", NULL};
    const char *path = NULL;
    int writer = 1;
    unsigned int max_views = 4096;
    unsigned long long max_blocks = 2000000, ring = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|zpIKK", kwlist, &path, &writer, &max_views, &max_blocks, &ring))
        return -1;
    if (self->ctl != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "already initialised");
        return -1;
    }
    if (max_views == 0 || max_views > MAX_VIEW_ID) {
        PyErr_SetString(PyExc_ValueError, "max_views out of range");
        return -1;
    }
    self->writer = writer;
    self->max_blocks_per_view = max_blocks;
    if (path != NULL) {
        self->path = PyMem_Malloc(strlen(path) + 1);
        if (self->path == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        strcpy(self->path, path);
    }
    if (!writer) {
        if (path == NULL) {
            PyErr_SetString(PyExc_ValueError, "a reader needs the path of the writer's index");
            return -1;
        }
        if (region_open(&self->ctl_r, path, 0) != 0) {
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
            return -1;
        }
        ctl_t *c = (ctl_t *)self->ctl_r.base;
        if (self->ctl_r.size < sizeof(ctl_t) || c->magic != CTL_MAGIC || c->version != VERSION ||
            self->ctl_r.size < ctl_size(c->max_views, c->ring_cap)) {
            PyErr_Format(PyExc_OSError, "%s is not a prefix index (yet)", path);
            return -1;
        }
        bind_ctl(self);
        return sync_reader(self);
    }
    uint64_t generation = 1;
    if (path == NULL) {
        if (region_anon(&self->ctl_r, ctl_size(max_views, ring)) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
    } else {
        /* A restarted writer takes the same file over: readers keep their mapping and see it emptied. */
        region_t old = {NULL, 0};
        if (region_open(&old, path, 0) == 0) {
            ctl_t *c = (ctl_t *)old.base;
            if (old.size >= sizeof(ctl_t) && c->magic == CTL_MAGIC) generation = c->generation + 1;
            region_close(&old);
        }
        /* A file no writer made before is emptied: all zeros, no view live. */
        if (region_file(&self->ctl_r, path, ctl_size(max_views, ring), generation == 1) != 0) {
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
            return -1;
        }
    }
    self->ctl = (ctl_t *)self->ctl_r.base;
    self->ctl->max_views = max_views;
    self->ctl->ring_cap = ring;
    bind_ctl(self);
    if (new_data(self, &self->data_r, generation, 1024, 1024) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    bind_data(self);
    self->mapped_gen = generation;
    if (path != NULL && generation > 1) {
        char *p = data_path(path, generation - 1); /* the writer before this one's */
        if (p != NULL) {
            unlink(p);
            PyMem_Free(p);
        }
    }
    ctl_t *c = self->ctl;
    if (generation > 1) /* a file taken over from a writer before: its views go (a new one is all zeros) */
        for (uint32_t v = 0; v < max_views; v++) STORE(&self->views[v].live, 0);
    memset(c->stats, 0, sizeof(c->stats));
    c->pairs_held = 0;
    c->offload_held = 0;
    STORE(&c->ring_head, 0);
    c->version = VERSION;
    c->writer_pid = (uint64_t)getpid();
    STORE(&c->views_version, c->views_version + 1);
    STORE(&c->generation, generation);
    STORE(&c->magic, CTL_MAGIC);
    self->priv = PyMem_Calloc(max_views, sizeof(vpriv_t));
    self->free_ids = PyMem_Malloc(max_views * sizeof(uint32_t));
    if (self->priv == NULL || self->free_ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static PyObject *BI_add_view(BlockIndex *self, PyObject *args) {
    const char *pod, *model;
    Py_ssize_t pod_len, model_len;
    unsigned int rank, block_size;
    unsigned long long root;
    if (!PyArg_ParseTuple(args, "s#Is#KI", &pod, &pod_len, &rank, &model, &model_len, &root, &block_size))
        return NULL;
    if (check_writer(self) != 0) return NULL;
    if ((size_t)pod_len >= sizeof(((view_t *)0)->pod)) {
        PyErr_SetString(PyExc_ValueError, "pod name too long");
        return NULL;
    }
    uint32_t id;
    if (self->nfree) id = self->free_ids[--self->nfree];
    else if (self->next_id < self->ctl->max_views) id = self->next_id++;
    else {
        PyErr_Format(PyExc_OverflowError, "the index holds %u views at most (kv_index.max_views)",
                     self->ctl->max_views);
        return NULL;
    }
    vpriv_t *p = &self->priv[id];
    p->model = PyMem_Malloc((size_t)model_len + 1);
    if (p->model == NULL) return PyErr_NoMemory();
    memcpy(p->model, model, (size_t)model_len);
    p->model[model_len] = 0;
    p->model_len = (size_t)model_len;
    p->root = root;
    p->pairs = 0;
    view_t *vr = &self->views[id];
    memset(vr, 0, sizeof(*vr));
    memcpy(vr->pod, pod, (size_t)pod_len);
    vr->rank = rank;
    vr->block_size = block_size;
    vr->last_seq = -1;
    STORE(&vr->live, 1);
    STORE(&self->ctl->views_version, self->ctl->views_version + 1);
    return PyLong_FromUnsignedLong(id);
}

static PyObject *owns_list_or_none(BlockIndex *self, int want) { (void)self; return want ? PyList_New(0) : NULL; }

static PyObject *BI_reset_view(BlockIndex *self, PyObject *args) {
    long view;
    int want = 1;
    if (!PyArg_ParseTuple(args, "l|p", &view, &want)) return NULL;
    if (check_writer(self) != 0 || check_view(self, view) != 0) return NULL;
    PyObject *gone = owns_list_or_none(self, want);
    if (want && gone == NULL) return NULL;
    if (clear_view(self, (uint32_t)view, 1, gone) != 0) {
        Py_XDECREF(gone);
        return NULL;
    }
    if (gone == NULL) Py_RETURN_NONE;
    return gone;
}

static PyObject *BI_drop_view(BlockIndex *self, PyObject *args) {
    long view;
    if (!PyArg_ParseTuple(args, "l", &view)) return NULL;
    if (check_writer(self) != 0 || check_view(self, view) != 0) return NULL;
    if (clear_view(self, (uint32_t)view, 0, NULL) != 0) return NULL;
    vpriv_t *p = &self->priv[view];
    PyMem_Free(p->order.v);
    PyMem_Free(p->model);
    memset(p, 0, sizeof(*p));
    STORE(&self->views[view].live, 0);
    self->free_ids[self->nfree++] = (uint32_t)view;
    STORE(&self->ctl->views_version, self->ctl->views_version + 1);
    Py_RETURN_NONE;
}

static PyObject *BI_set_view(BlockIndex *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"view", "last_seq", "approximate", "block_size", NULL};
    long view;
    PyObject *last_seq = Py_None, *approximate = Py_None, *block_size = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "l|OOO", kwlist, &view, &last_seq, &approximate, &block_size))
        return NULL;
    if (check_writer(self) != 0 || check_view(self, view) != 0) return NULL;
    view_t *vr = &self->views[view];
    if (last_seq != Py_None) {
        long long s = PyLong_AsLongLong(last_seq);
        if (s == -1 && PyErr_Occurred()) return NULL;
        STORE(&vr->last_seq, (int64_t)s);
    }
    if (approximate != Py_None) STORE(&vr->approximate, (uint32_t)PyObject_IsTrue(approximate));
    if (block_size != Py_None) {
        long bs = PyLong_AsLong(block_size);
        if (bs == -1 && PyErr_Occurred()) return NULL;
        STORE(&vr->block_size, (uint32_t)bs);
    }
    Py_RETURN_NONE;
}

static PyObject *BI_set_counters(BlockIndex *self, PyObject *args) {
    long view;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "lO", &view, &seq)) return NULL;
    if (check_writer(self) != 0 || check_view(self, view) != 0) return NULL;
    PyObject *fast = PySequence_Fast(seq, "counters must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n && i < SUB_COUNTERS; i++) {
        unsigned long long v = PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(fast, i));
        STORE(&self->views[view].counters[i], v);
    }
    Py_DECREF(fast);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *BI_own_of(BlockIndex *self, PyObject *args) {
    long view;
    PyObject *h;
    if (!PyArg_ParseTuple(args, "lO", &view, &h)) return NULL;
    if (check_writer(self) != 0 || check_view(self, view) != 0) return NULL;
    uint64_t ehash;
    if (as_hash(h, &ehash) != 0) return NULL;
    int64_t e = emap_find(&self->priv[view].emap, ehash);
    if (e < 0) Py_RETURN_NONE;
    return u64(self->priv[view].emap.vals[e]);
}

/* store(view, parent_own or None, engine_hashes, own_hashes, offload, block_size) */
static PyObject *BI_store(BlockIndex *self, PyObject *args) {
    long view;
    PyObject *parent, *ehashes, *owns;
    int offload;
    unsigned int block_size;
    if (!PyArg_ParseTuple(args, "lOO!O!pI", &view, &parent, &PyList_Type, &ehashes, &PyList_Type, &owns, &offload,
                          &block_size))
        return NULL;
    if (check_writer(self) != 0 || check_view(self, view) != 0) return NULL;
    if (PyList_GET_SIZE(ehashes) != PyList_GET_SIZE(owns)) {
        PyErr_SetString(PyExc_ValueError, "one own hash per engine hash");
        return NULL;
    }
    uint64_t parent_own = 0;
    if (parent != Py_None && as_hash(parent, &parent_own) != 0) return NULL;
    self->views[view].block_size = block_size;
    Py_ssize_t n = PyList_GET_SIZE(ehashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t e, o;
        if (as_hash(PyList_GET_ITEM(ehashes, i), &e) != 0 || as_hash(PyList_GET_ITEM(owns, i), &o) != 0) return NULL;
        if (store_one(self, (uint32_t)view, e, o, parent_own, offload) != 0) return NULL;
        parent_own = o;
    }
    self->ctl->stats[ST_STORED] += (uint64_t)n;
    if (after_store(self, (uint32_t)view) != 0) return NULL;
    Py_RETURN_NONE;
}

/* remove(view, engine_hashes, offload) -> own hashes evicted from the GPU tier */
static PyObject *BI_remove(BlockIndex *self, PyObject *args) {
    long view;
    PyObject *ehashes;
    int offload;
    if (!PyArg_ParseTuple(args, "lO!p", &view, &PyList_Type, &ehashes, &offload)) return NULL;
    if (check_writer(self) != 0 || check_view(self, view) != 0) return NULL;
    PyObject *evicted = PyList_New(0);
    if (evicted == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ehashes); i++) {
        uint64_t e, own;
        if (as_hash(PyList_GET_ITEM(ehashes, i), &e) != 0) goto fail;
        int r = remove_one(self, (uint32_t)view, e, offload, &own);
        if (r == 2) {
            self->ctl->stats[ST_UNKNOWN_REMOVED]++;
            continue;
        }
        self->ctl->stats[ST_REMOVED]++;
        if (r == 1 && note_own(self, (uint32_t)view, NOTE_EVICTED, own, evicted) != 0) goto fail;
    }
    return evicted;
fail:
    Py_DECREF(evicted);
    return NULL;
}

static PyObject *BI_count(BlockIndex *self, PyObject *args) {
    const char *name;
    unsigned long long n = 1;
    if (!PyArg_ParseTuple(args, "s|K", &name, &n)) return NULL;
    if (check_writer(self) != 0) return NULL;
    static const char *names[ST_COUNT] = {"blocks_stored", "blocks_removed", "clears", "unknown_parent",
                                          "unknown_removed", "rejected", "evicted_for_memory"};
    for (int i = 0; i < ST_COUNT; i++)
        if (strcmp(names[i], name) == 0) {
            self->ctl->stats[i] += n;
            Py_RETURN_NONE;
        }
    PyErr_Format(PyExc_KeyError, "no counter %s", name);
    return NULL;
}

/* apply(view, payload, notes) -> False (the Python decoder must take the batch: nothing was applied), or
 * the list of what the eviction listener is told: ("evicted" | "cleared", own hashes), when ``notes``. */
static PyObject *BI_apply(BlockIndex *self, PyObject *args) {
    long view;
    Py_buffer payload;
    int want_notes = 0;
    if (!PyArg_ParseTuple(args, "ly*|p", &view, &payload, &want_notes)) return NULL;
    if (check_writer(self) != 0 || check_view(self, view) != 0) {
        PyBuffer_Release(&payload);
        return NULL;
    }
    mp_t m = {(const uint8_t *)payload.buf, (const uint8_t *)payload.buf + payload.len};
    uint32_t top, n;
    ev_t small[32];
    ev_t *events = small;
    PyObject *result = NULL;
    if (!mp_array(&m, &top) || top < 2 || top > 3 || !mp_number(&m) || !mp_array(&m, &n)) goto fallback;
    if (n > 32 && (events = PyMem_Malloc(n * sizeof(ev_t))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint32_t bs = self->views[view].block_size;
    for (uint32_t i = 0; i < n; i++) {
        if (!parse_event(&m, &events[i])) goto fallback;
        /* A block size that changes is logged by the Python path. */
        if (events[i].kind == EV_STORED && bs && events[i].block_size > 0 && (uint64_t)events[i].block_size != bs)
            goto fallback;
        if (events[i].kind == EV_STORED && events[i].block_size > 0) bs = (uint32_t)events[i].block_size;
    }
    if (top == 3) {
        uint64_t rank;
        int neg;
        if (!mp_nil(&m) && !mp_int(&m, &rank, &neg)) goto fallback;
    }
    if (m.p != m.end) goto fallback;
    self->notes = want_notes ? PyList_New(0) : NULL;
    if (want_notes && self->notes == NULL) goto done;
    for (uint32_t i = 0; i < n; i++) {
        int rc = events[i].kind == EV_STORED ? apply_stored(self, (uint32_t)view, &events[i])
               : events[i].kind == EV_REMOVED ? apply_removed(self, (uint32_t)view, &events[i])
               : apply_cleared(self, (uint32_t)view);
        if (rc != 0) {
            Py_CLEAR(self->notes);
            goto done;
        }
    }
    result = self->notes != NULL ? self->notes : PyList_New(0);
    self->notes = NULL;
    goto done;
fallback:
    result = Py_False;
    Py_INCREF(result);
done:
    if (events != small) PyMem_Free(events);
    PyBuffer_Release(&payload);
    return result;
}

/* ---- reading ---- */

static int hashes_at(PyObject *list, Py_ssize_t i, uint64_t *out) {
    PyObject *o = PyList_GET_ITEM(list, i);
    uint64_t v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (uint64_t)-1 && PyErr_Occurred()) return -1;
    *out = fold(v);
    return 0;
}

/* Whether the view (-1: any view, GPU tier) holds the block; any_tier: GPU or offload. */
static int holds(BlockIndex *self, long view, uint64_t own, int any_tier) {
    if (view < 0) {
        int64_t b = block_find(self, own);
        return b >= 0 && LOAD(&self->blocks[b].gpu_holders) > 0;
    }
    uint64_t v = pair_value(self, own, (uint32_t)view);
    return V_GPU(v) > 0 || (any_tier && V_OFF(v) > 0);
}

/* The first position in [start, count) of ``hashes`` the view (-1: any view's GPU tier) does not hold: walked block
 * by block, or (a view closed under prefixes) found by checking the last position, then bisecting; -1 on error. */
static int64_t run_of(BlockIndex *self, long view, PyObject *hashes, Py_ssize_t start, Py_ssize_t count, int walk,
                      int any_tier) {
    uint64_t h;
    if (start >= count) return count;
    if (walk) {
        Py_ssize_t i = start;
        for (; i < count; i++) {
            if (hashes_at(hashes, i, &h) != 0) return -1;
            if (!holds(self, view, h, any_tier)) break;
        }
        return i;
    }
    if (hashes_at(hashes, count - 1, &h) != 0) return -1;
    if (holds(self, view, h, any_tier)) return count;
    Py_ssize_t lo = start, hi = count - 1;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (hashes_at(hashes, mid, &h) != 0) return -1;
        if (holds(self, view, h, any_tier)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* run(view, hashes, start, end, walk, any_tier) -> the first position in [start, end) not held (see run_of). */
static PyObject *BI_run(BlockIndex *self, PyObject *args) {
    long view;
    PyObject *hashes;
    Py_ssize_t start, end;
    int walk = 0, any_tier = 0;
    if (!PyArg_ParseTuple(args, "lO!nn|pp", &view, &PyList_Type, &hashes, &start, &end, &walk, &any_tier))
        return NULL;
    if (sync_reader(self) != 0) return NULL;
    if (view >= 0 && check_view(self, view) != 0) return NULL;
    if (end > PyList_GET_SIZE(hashes)) end = PyList_GET_SIZE(hashes);
    int64_t r = run_of(self, view, hashes, start < 0 ? 0 : start, end, walk, any_tier);
    return r < 0 ? NULL : PyLong_FromLongLong(r);
}

/* runs(views, starts, hashes, count) -> per view, the first position in [start, count) its GPU tier does not hold:
 * bisected for a view closed under prefixes, walked for one with orphans; ``starts`` None: from 0. A view no
 * longer there: 0. One call for every candidate of a lookup. */
static PyObject *BI_runs(BlockIndex *self, PyObject *args) {
    PyObject *views, *starts, *hashes;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "O!OO!n", &PyList_Type, &views, &starts, &PyList_Type, &hashes, &count)) return NULL;
    if (starts != Py_None && (!PyList_Check(starts) || PyList_GET_SIZE(starts) != PyList_GET_SIZE(views))) {
        PyErr_SetString(PyExc_ValueError, "one start per view");
        return NULL;
    }
    if (sync_reader(self) != 0) return NULL;
    if (count > PyList_GET_SIZE(hashes)) count = PyList_GET_SIZE(hashes);
    Py_ssize_t n = PyList_GET_SIZE(views);
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        long view = PyLong_AsLong(PyList_GET_ITEM(views, k));
        Py_ssize_t start = starts == Py_None ? 0 : PyLong_AsSsize_t(PyList_GET_ITEM(starts, k));
        if (PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        int64_t r = 0;
        if (view >= 0 && (uint64_t)view < self->ctl->max_views && LOAD(&self->views[view].live)) {
            r = run_of(self, view, hashes, start < 0 ? 0 : start, count, LOAD(&self->views[view].orphans) != 0, 0);
            if (r < 0) {
                Py_DECREF(out);
                return NULL;
            }
        }
        PyList_SET_ITEM(out, k, PyLong_FromLongLong(r));
    }
    return out;
}

static PyObject *BI_offload_held(BlockIndex *self, PyObject *Py_UNUSED(ignored)) {
    return u64(LOAD(&self->ctl->offload_held));
}

/* holders(own) -> (views holding it on GPU, some of them) */
static PyObject *BI_holders(BlockIndex *self, PyObject *args) {
    PyObject *h;
    if (!PyArg_ParseTuple(args, "O", &h)) return NULL;
    if (sync_reader(self) != 0) return NULL;
    uint64_t own;
    if (as_hash(h, &own) != 0) return NULL;
    int64_t b = block_find(self, own);
    PyObject *some = PyList_New(0);
    if (some == NULL) return NULL;
    uint32_t count = 0;
    if (b >= 0) {
        block_t *blk = &self->blocks[b];
        count = LOAD(&blk->gpu_holders);
        for (int i = 0; i < HINTS; i++) {
            uint16_t v = LOAD(&blk->hint[i]);
            if (v == NO_VIEW16) continue;
            PyObject *o = PyLong_FromUnsignedLong(v);
            if (o == NULL || PyList_Append(some, o) != 0) {
                Py_XDECREF(o);
                Py_DECREF(some);
                return NULL;
            }
            Py_DECREF(o);
        }
        if (LOAD(&blk->own) != own) { /* changed while read: no hint is better than a wrong one */
            Py_DECREF(some);
            return Py_BuildValue("(I[])", 0);
        }
    }
    PyObject *out = Py_BuildValue("(IN)", count, some);
    return out;
}

static PyObject *BI_holds(BlockIndex *self, PyObject *args) {
    long view;
    PyObject *h;
    if (!PyArg_ParseTuple(args, "lO", &view, &h)) return NULL;
    if (sync_reader(self) != 0 || check_view(self, view) != 0) return NULL;
    uint64_t own;
    if (as_hash(h, &own) != 0) return NULL;
    uint64_t v = pair_value(self, own, (uint32_t)view);
    return Py_BuildValue("(II)", V_GPU(v), V_OFF(v));
}

static PyObject *BI_view_info(BlockIndex *self, PyObject *args) {
    long view;
    if (!PyArg_ParseTuple(args, "l", &view)) return NULL;
    if (view < 0 || (uint64_t)view >= self->ctl->max_views) {
        PyErr_Format(PyExc_KeyError, "no view %ld", view);
        return NULL;
    }
    view_t *v = &self->views[view];
    return Py_BuildValue("{s:O,s:s,s:I,s:I,s:O,s:L,s:K,s:K,s:L,s:K,s:K}", "live", LOAD(&v->live) ? Py_True : Py_False,
                         "pod", v->pod, "rank", v->rank, "block_size", LOAD(&v->block_size), "approximate",
                         LOAD(&v->approximate) ? Py_True : Py_False, "last_seq", (long long)LOAD(&v->last_seq),
                         "gpu_blocks", (unsigned long long)LOAD(&v->gpu_blocks), "blocks",
                         (unsigned long long)LOAD(&v->blocks), "orphans", (long long)LOAD(&v->orphans),
                         "evictions", (unsigned long long)LOAD(&v->evictions), "engine_hashes",
                         (unsigned long long)LOAD(&v->engine_hashes));
}

/* One field of a view, read on the request path without building a dict. */
static PyObject *BI_view_field(BlockIndex *self, PyObject *args) {
    long view;
    int field;
    if (!PyArg_ParseTuple(args, "li", &view, &field)) return NULL;
    if (view < 0 || (uint64_t)view >= self->ctl->max_views) {
        PyErr_Format(PyExc_KeyError, "no view %ld", view);
        return NULL;
    }
    view_t *v = &self->views[view];
    switch (field) {
        case 0: return PyLong_FromUnsignedLong(LOAD(&v->block_size));
        case 1: return PyBool_FromLong(LOAD(&v->approximate));
        case 2: return PyLong_FromLongLong(LOAD(&v->last_seq));
        case 3: return u64(LOAD(&v->gpu_blocks));
        case 4: return u64(LOAD(&v->blocks));
        case 5: return PyLong_FromLongLong(LOAD(&v->orphans));
        case 6: return u64(LOAD(&v->evictions));
        case 7: return u64(LOAD(&v->engine_hashes));
        case 8: return PyBool_FromLong(LOAD(&v->live));
        default: break;
    }
    PyErr_SetString(PyExc_ValueError, "no such field");
    return NULL;
}

static PyObject *BI_counters(BlockIndex *self, PyObject *args) {
    long view;
    if (!PyArg_ParseTuple(args, "l", &view)) return NULL;
    if (view < 0 || (uint64_t)view >= self->ctl->max_views) {
        PyErr_Format(PyExc_KeyError, "no view %ld", view);
        return NULL;
    }
    PyObject *out = PyTuple_New(SUB_COUNTERS);
    if (out == NULL) return NULL;
    for (int i = 0; i < SUB_COUNTERS; i++) PyTuple_SET_ITEM(out, i, u64(LOAD(&self->views[view].counters[i])));
    return out;
}

/* views() -> [(id, pod, rank)] of the live views, and the views' version they were read at */
static PyObject *BI_views(BlockIndex *self, PyObject *Py_UNUSED(ignored)) {
    uint64_t version = LOAD(&self->ctl->views_version);
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (uint32_t v = 0; v < self->ctl->max_views; v++) {
        view_t *vr = &self->views[v];
        if (!LOAD(&vr->live)) continue;
        char pod[sizeof(vr->pod)];
        memcpy(pod, vr->pod, sizeof(pod));
        pod[sizeof(pod) - 1] = 0;
        PyObject *item = Py_BuildValue("(IsI)", v, pod, vr->rank);
        if (item == NULL || PyList_Append(out, item) != 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return Py_BuildValue("(KN)", (unsigned long long)version, out);
}

static PyObject *BI_views_version(BlockIndex *self, PyObject *Py_UNUSED(ignored)) {
    return u64(LOAD(&self->ctl->views_version));
}

/* own_hashes(view) -> the blocks the view holds in any tier */
static PyObject *BI_own_hashes(BlockIndex *self, PyObject *args) {
    long view;
    if (!PyArg_ParseTuple(args, "l", &view)) return NULL;
    if (sync_reader(self) != 0 || check_view(self, view) != 0) return NULL;
    PyObject *out = PySet_New(NULL);
    if (out == NULL) return NULL;
    for (uint64_t i = 0; i < self->d->pair_cap; i++) {
        pair_t *p = &self->pairs[i];
        uint64_t own = LOAD(&p->own), v = LOAD(&p->val);
        if (own <= TOMB || V_VIEW(v) != (uint32_t)view || (!V_GPU(v) && !V_OFF(v))) continue;
        PyObject *o = u64(own);
        if (o == NULL || PySet_Add(out, o) != 0) {
            Py_XDECREF(o);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(o);
    }
    return out;
}

/* drain(cursor) -> (cursor, lost, [(view, "evicted" | "cleared", [own, ...]), ...]): the notes written since
 * ``cursor`` (None: from now on), consecutive ones of a view and kind together; ``lost``: notes the ring had
 * overwritten before they were read. */
static PyObject *BI_drain(BlockIndex *self, PyObject *args) {
    PyObject *cursor_obj;
    if (!PyArg_ParseTuple(args, "O", &cursor_obj)) return NULL;
    uint64_t cap = self->ctl->ring_cap, head = LOAD(&self->ctl->ring_head);
    if (cursor_obj == Py_None) return Py_BuildValue("(Ki[])", (unsigned long long)head, 0);
    uint64_t cursor = PyLong_AsUnsignedLongLong(cursor_obj);
    if (cursor == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    uint64_t lost = 0;
    if (cursor > head) cursor = head; /* a restarted writer: its ring starts again */
    if (cap && head - cursor > cap) {
        lost = head - cap - cursor;
        cursor = head - cap;
    }
    PyObject *groups = PyList_New(0);
    if (groups == NULL) return NULL;
    PyObject *owns = NULL;
    uint32_t group_view = 0, group_kind = 0;
    for (uint64_t c = cursor; cap && c < head; c++) {
        note_t *n = &self->ring[c % cap];
        uint64_t s1 = LOAD(&n->seq);
        uint64_t own = n->own;
        uint32_t view = n->view, kind = n->kind;
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (s1 != c || LOAD(&n->seq) != c) {
            lost++; /* overwritten while read */
            continue;
        }
        if (owns == NULL || view != group_view || kind != group_kind) {
            owns = PyList_New(0);
            PyObject *item = owns == NULL ? NULL
                : Py_BuildValue("(IsN)", view, kind == NOTE_EVICTED ? "evicted" : "cleared", owns);
            if (item == NULL || PyList_Append(groups, item) != 0) {
                Py_XDECREF(item);
                Py_DECREF(groups);
                return NULL;
            }
            Py_DECREF(item); /* the group list holds it; ``owns`` stays borrowed from it */
            group_view = view;
            group_kind = kind;
        }
        PyObject *o = u64(own);
        if (o == NULL || PyList_Append(owns, o) != 0) {
            Py_XDECREF(o);
            Py_DECREF(groups);
            return NULL;
        }
        Py_DECREF(o);
    }
    return Py_BuildValue("(KKN)", (unsigned long long)head, (unsigned long long)lost, groups);
}

static PyObject *BI_stats(BlockIndex *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyTuple_New(ST_COUNT);
    if (out == NULL) return NULL;
    for (int i = 0; i < ST_COUNT; i++) PyTuple_SET_ITEM(out, i, u64(LOAD(&self->ctl->stats[i])));
    return out;
}

static PyObject *BI_size(BlockIndex *self, PyObject *Py_UNUSED(ignored)) {
    return u64(LOAD(&self->ctl->pairs_held));
}

/* memory() -> bytes: the tables (shared), and the writer's private maps */
static PyObject *BI_memory(BlockIndex *self, PyObject *Py_UNUSED(ignored)) {
    if (sync_reader(self) != 0) return NULL;
    uint64_t private_bytes = 0;
    if (self->priv != NULL)
        for (uint32_t v = 0; v < self->ctl->max_views; v++)
            private_bytes += self->priv[v].emap.cap * 16 + self->priv[v].order.cap * 8;
    uint32_t views = 0;
    for (uint32_t v = 0; v < self->ctl->max_views; v++) views += LOAD(&self->views[v].live) ? 1 : 0;
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "tables", (unsigned long long)self->data_r.size, "private",
                         (unsigned long long)private_bytes, "views", (unsigned long long)views * sizeof(view_t),
                         "blocks", (unsigned long long)self->d->block_live, "pairs",
                         (unsigned long long)self->d->pair_live, "generation",
                         (unsigned long long)self->mapped_gen, "writer_pid",
                         (unsigned long long)LOAD(&self->ctl->writer_pid));
}

static PyObject *BI_get_writer(BlockIndex *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->writer);
}

static PyObject *BI_get_max_blocks(BlockIndex *self, void *closure) {
    (void)closure;
    return u64(self->max_blocks_per_view);
}

static int BI_set_max_blocks(BlockIndex *self, PyObject *value, void *closure) {
    (void)closure;
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    self->max_blocks_per_view = v;
    return 0;
}

static PyMethodDef BI_methods[] = {
    {"add_view", (PyCFunction)BI_add_view, METH_VARARGS, "add_view(pod, rank, model, root, block_size) -> id"},
    {"reset_view", (PyCFunction)BI_reset_view, METH_VARARGS, "reset_view(view, list_gone=True) -> GPU blocks it held"},
    {"drop_view", (PyCFunction)BI_drop_view, METH_VARARGS, "drop_view(view): forget it, and free its id"},
    {"set_view", (PyCFunction)(void (*)(void))BI_set_view, METH_VARARGS | METH_KEYWORDS,
     "set_view(view, last_seq=None, approximate=None, block_size=None)"},
    {"set_counters", (PyCFunction)BI_set_counters, METH_VARARGS, "set_counters(view, counters): for readers"},
    {"own_of", (PyCFunction)BI_own_of, METH_VARARGS, "own_of(view, engine_hash) -> own hash or None"},
    {"store", (PyCFunction)BI_store, METH_VARARGS,
     "store(view, parent_own, engine_hashes, own_hashes, offload, block_size)"},
    {"remove", (PyCFunction)BI_remove, METH_VARARGS, "remove(view, engine_hashes, offload) -> GPU blocks evicted"},
    {"count", (PyCFunction)BI_count, METH_VARARGS, "count(counter, n=1)"},
    {"apply", (PyCFunction)BI_apply, METH_VARARGS, "apply(view, payload, notes=False) -> notes list, or False"},
    {"run", (PyCFunction)BI_run, METH_VARARGS, "run(view, hashes, start, end, walk=False, any_tier=False) -> int"},
    {"holders", (PyCFunction)BI_holders, METH_VARARGS, "holders(own) -> (count, some view ids)"},
    {"runs", (PyCFunction)BI_runs, METH_VARARGS, "runs(views, starts, hashes, count) -> each view's run"},
    {"offload_held", (PyCFunction)BI_offload_held, METH_NOARGS, "offload_held() -> pairs with offload copies"},
    {"holds", (PyCFunction)BI_holds, METH_VARARGS, "holds(view, own) -> (GPU copies, offload copies)"},
    {"view_info", (PyCFunction)BI_view_info, METH_VARARGS, "view_info(view) -> dict"},
    {"view_field", (PyCFunction)BI_view_field, METH_VARARGS, "view_field(view, field) -> value"},
    {"counters", (PyCFunction)BI_counters, METH_VARARGS, "counters(view) -> its subscriber's counters"},
    {"views", (PyCFunction)BI_views, METH_NOARGS, "views() -> (version, [(id, pod, rank)])"},
    {"views_version", (PyCFunction)BI_views_version, METH_NOARGS, "views_version() -> int"},
    {"own_hashes", (PyCFunction)BI_own_hashes, METH_VARARGS, "own_hashes(view) -> set"},
    {"stats", (PyCFunction)BI_stats, METH_NOARGS, "stats() -> the index's counters"},
    {"drain", (PyCFunction)BI_drain, METH_VARARGS, "drain(cursor) -> (cursor, lost, [(view, kind, owns)])"},
    {"size", (PyCFunction)BI_size, METH_NOARGS, "size() -> (block, view) pairs held"},
    {"memory", (PyCFunction)BI_memory, METH_NOARGS, "memory() -> dict of bytes and entries"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef BI_getset[] = {
    {"writer", (getter)BI_get_writer, NULL, "whether this handle writes", NULL},
    {"max_blocks_per_view", (getter)BI_get_max_blocks, (setter)BI_set_max_blocks, "the memory bound per view", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BlockIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gateway.kv._blockindex.BlockIndex",
    .tp_basicsize = sizeof(BlockIndex),
    .tp_dealloc = (destructor)BlockIndex_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Which engine views hold which token blocks: private to a process, or shared by a host's processes.",
    .tp_methods = BI_methods,
    .tp_getset = BI_getset,
    .tp_init = (initproc)BlockIndex_init,
    .tp_new = PyType_GenericNew,
};

/* hash64(data, seed=0) -> the gateway's hash of a bytes-like object (``hash64`` above) */
static PyObject *py_hash64(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "hash64(data, seed=0)");
        return NULL;
    }
    uint64_t seed = 0;
    if (nargs == 2) {
        seed = PyLong_AsUnsignedLongLong(args[1]);
        if (seed == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    }
    if (PyBytes_Check(args[0]))
        return u64(hash64(PyBytes_AS_STRING(args[0]), (size_t)PyBytes_GET_SIZE(args[0]), seed));
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t h = hash64(view.buf, (size_t)view.len, seed);
    PyBuffer_Release(&view);
    return u64(h);
}

static PyMethodDef module_methods[] = {
    {"hash64", (PyCFunction)(void (*)(void))py_hash64, METH_FASTCALL, "hash64(data, seed=0) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gateway.kv._blockindex",
    "The prefix index's native storage and KV-event decoder (gateway/kv/native/blockindex.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__blockindex(void) {
    if (PyType_Ready(&BlockIndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&BlockIndexType);
    if (PyModule_AddObject(m, "BlockIndex", (PyObject *)&BlockIndexType) < 0) {
        Py_DECREF(&BlockIndexType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "SUBSCRIBER_COUNTERS", SUB_COUNTERS);
    return m;
}
