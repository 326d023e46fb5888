/*
 * The allocation functions that torch.cuda.memory.CUDAPluggableAllocator loads
 * for a vmmd MemPool. PyTorch calls them holding its caching allocator's mutex,
 * and a thread holding the GIL may be waiting for that mutex
 * (torch.cuda.memory_stats()), so they never touch Python: blocks are carved
 * from chunks that the package's refill thread (vmmd._torch_chunks) leased and
 * mapped beforehand and handed over with vmmd_add_chunk; frees stay here, and
 * chunks with nothing in use go back through that thread. A malloc that finds
 * no room asks the refill thread and waits for it with a time limit, holding
 * nothing but PyTorch's mutex: if the refill thread cannot run (the GIL held by
 * a thread that waits for that mutex), the wait ends in NULL, PyTorch's out of
 * memory, never in a hang. The refill thread never calls into PyTorch.
 *
 * Chunks carry a tag (0: none; vmmd.torch numbers the tags of its regions): a
 * malloc carves only from chunks of the tag its thread set (vmmd_set_tag, a
 * thread-local, as torch_memory_saver's region config), and never from a
 * chunk put to sleep (vmmd_set_asleep): its range stays reserved with nothing
 * mapped until the package wakes it. Room, refills and waits are per
 * (tag, device) slot.
 *
 * Reuse is stream-ordered, as in PyTorch's own allocator: a block freed on a
 * stream is reused at once by that stream, by another only once an event
 * recorded on the freeing stream (after the free) is done. The event calls are
 * the driver's (cuEventCreate...), handed over by vmmd_set_driver; without them
 * a freed block is free at once (host tests).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#define ALIGNMENT 512
#define MAX_DEVICES 64
#define MAX_TAGS 16
#define SLOTS (MAX_TAGS * MAX_DEVICES)
#define SLOT(tag, device) ((tag) * MAX_DEVICES + (device))
#define CU_EVENT_DISABLE_TIMING 2
#define CU_SUCCESS 0

enum { SPAN_FREE, SPAN_USED, SPAN_HELD };
/* What vmmd_next_request answers. */
enum { NEXT_TICK, NEXT_REFILL, NEXT_RETURN, NEXT_STOP };
/* Which chunks vmmd_take_empty_chunk takes. */
enum { TAKE_FREED, TAKE_IDLE };

typedef int (*event_create_fn)(void **event, unsigned int flags);
typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*event_query_fn)(void *event);
typedef int (*event_sync_fn)(void *event);
typedef int (*event_destroy_fn)(void *event);

typedef struct {
  uint64_t offset, size;
  int state;
  void *stream; /* USED: allocated for; HELD: freed on */
  void *event;  /* HELD: recorded on `stream` after the free, or NULL until one is needed */
} span_t;

typedef struct {
  int device, tag;
  int asleep; /* unmapped, range kept: no malloc carves from it, it is never given back */
  uint64_t base, size;
  /* Invariant: spans cover [0, size) in order; no two FREE spans touch. */
  span_t *spans;
  int count, capacity;
  int freed; /* nothing in use since PyTorch freed a block of it: give it back */
  double last_use;
  int own; /* leased for one large request (the CuPy library): small requests never split it */
} chunk_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t refilled = PTHREAD_COND_INITIALIZER; /* mallocs waiting for room */
static pthread_cond_t wanted = PTHREAD_COND_INITIALIZER;   /* the refill thread waiting for work */
/* Invariant: every chunk is mapped and owned by the refill thread's pool until taken back. */
static chunk_t *chunks;
static int chunk_count, chunk_capacity;
/* Bytes a malloc waits for, per slot (0: none); generation counts refills and failures. */
static uint64_t want[SLOTS];
static uint64_t generation[SLOTS], failed_generation[SLOTS];
/* FREE bytes of awake chunks per slot, and its largest malloc: a refill goes ahead once the room is
 * below low_water plus the largest malloc, so that the next one like it need not wait. */
static uint64_t room[SLOTS], largest[SLOTS];
/* Bytes of the chunks held per slot; a refill goes ahead also to keep ahead_fraction of them free:
 * the refill thread needs the GIL, and a burst of mallocs may come while it cannot have it. */
static uint64_t held[SLOTS];
/* The tag this thread's mallocs carve from. */
static __thread int current_tag;
static double ahead_fraction = 0.25;
static int return_wanted, stopping;
static double refill_timeout = 5.0;
static uint64_t low_water;
static struct {
  event_create_fn create;
  event_record_fn record;
  event_query_fn query;
  event_sync_fn sync;
  event_destroy_fn destroy;
} cu;
/* mallocs, frees, same-stream reuses, stream waits, refill waits, timeouts, failures, unknown frees */
static uint64_t counters[8];

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

void vmmd_set_driver(void *create, void *record, void *query, void *sync, void *destroy) {
  pthread_mutex_lock(&lock);
  cu.create = (event_create_fn)create;
  cu.record = (event_record_fn)record;
  cu.query = (event_query_fn)query;
  cu.sync = (event_sync_fn)sync;
  cu.destroy = (event_destroy_fn)destroy;
  pthread_mutex_unlock(&lock);
}

void vmmd_configure(double timeout_seconds, uint64_t ahead_bytes, double fraction) {
  pthread_mutex_lock(&lock);
  refill_timeout = timeout_seconds;
  low_water = ahead_bytes;
  ahead_fraction = fraction;
  pthread_mutex_unlock(&lock);
}

void vmmd_counters(uint64_t *out) {
  pthread_mutex_lock(&lock);
  memcpy(out, counters, sizeof(counters));
  pthread_mutex_unlock(&lock);
}

static int insert_span(chunk_t *c, int at, span_t span) {
  if (c->count == c->capacity) {
    int capacity = c->capacity ? c->capacity * 2 : 8;
    span_t *grown = realloc(c->spans, sizeof(span_t) * (size_t)capacity);
    if (grown == NULL) return -1;
    c->spans = grown;
    c->capacity = capacity;
  }
  memmove(&c->spans[at + 1], &c->spans[at], sizeof(span_t) * (size_t)(c->count - at));
  c->spans[at] = span;
  c->count++;
  return 0;
}

static void drop_event(span_t *s) {
  if (s->event != NULL && cu.destroy != NULL) cu.destroy(s->event);
  s->event = NULL;
}

static void coalesce(chunk_t *c) {
  for (int i = 0; i + 1 < c->count;) {
    if (c->spans[i].state == SPAN_FREE && c->spans[i + 1].state == SPAN_FREE) {
      c->spans[i].size += c->spans[i + 1].size;
      memmove(&c->spans[i + 1], &c->spans[i + 2], sizeof(span_t) * (size_t)(c->count - i - 2));
      c->count--;
    } else {
      i++;
    }
  }
}

/* Makes [offset, +size) of span i USED for `stream`; the rest of the span keeps its state. */
static void *take(chunk_t *c, int i, uint64_t size, void *stream) {
  span_t *s = &c->spans[i];
  int was = s->state;
  drop_event(s); /* a remainder still HELD gets a later event: later is safe */
  if (s->size > size) {
    span_t rest = {s->offset + size, s->size - size, was, s->stream, NULL};
    if (insert_span(c, i + 1, rest) != 0) return NULL;
    s = &c->spans[i];
  }
  s->size = size;
  s->state = SPAN_USED;
  s->stream = stream;
  if (was == SPAN_FREE) room[SLOT(c->tag, c->device)] -= size;
  c->freed = 0;
  c->last_use = now();
  return (void *)(uintptr_t)(c->base + s->offset);
}

static void *carve(int device, int tag, uint64_t size, void *stream) {
  /* A block this stream freed first: its work runs after the work before the free. */
  for (int k = 0; k < chunk_count; k++) {
    chunk_t *c = &chunks[k];
    if (c->device != device || c->tag != tag || c->asleep) continue;
    for (int i = 0; i < c->count; i++) {
      if (c->spans[i].state == SPAN_HELD && c->spans[i].stream == stream && c->spans[i].size >= size) {
        counters[2]++;
        return take(c, i, size, stream);
      }
    }
  }
  for (int k = 0; k < chunk_count; k++) {
    chunk_t *c = &chunks[k];
    if (c->device != device || c->tag != tag || c->asleep) continue;
    for (int i = 0; i < c->count; i++) {
      if (c->spans[i].state == SPAN_FREE && c->spans[i].size >= size) return take(c, i, size, stream);
    }
  }
  return NULL;
}

/* HELD spans of the tag's awake chunks on `device` whose stream's work is done become FREE
 * (waiting for it when `wait`). Returns the bytes still HELD. */
static uint64_t settle(int device, int tag, int wait) {
  uint64_t held = 0;
  for (int k = 0; k < chunk_count; k++) {
    chunk_t *c = &chunks[k];
    if (c->device != device || c->tag != tag || c->asleep) continue;
    for (int i = 0; i < c->count; i++) {
      span_t *s = &c->spans[i];
      if (s->state != SPAN_HELD) continue;
      int done = cu.create == NULL;
      if (!done && s->event == NULL) {
        void *event = NULL;
        if (cu.create(&event, CU_EVENT_DISABLE_TIMING) == CU_SUCCESS) {
          if (cu.record(event, s->stream) == CU_SUCCESS) s->event = event;
          else cu.destroy(event);
        }
      }
      if (!done && s->event != NULL) done = (wait ? cu.sync(s->event) : cu.query(s->event)) == CU_SUCCESS;
      if (!done) {
        held += s->size;
        continue;
      }
      drop_event(s);
      s->state = SPAN_FREE;
      room[SLOT(tag, device)] += s->size;
    }
    coalesce(c);
  }
  return held;
}

static void deadline_after(struct timespec *t, double seconds) {
  clock_gettime(CLOCK_REALTIME, t);
  double whole = (double)(time_t)seconds;
  t->tv_sec += (time_t)seconds;
  t->tv_nsec += (long)((seconds - whole) * 1e9);
  if (t->tv_nsec >= 1000000000L) {
    t->tv_sec++;
    t->tv_nsec -= 1000000000L;
  }
}

void *vmmd_torch_malloc(ssize_t requested, int device, void *stream) {
  if (requested <= 0 || device < 0 || device >= MAX_DEVICES) return NULL;
  uint64_t size = ((uint64_t)requested + ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT;
  int tag = current_tag, slot = SLOT(tag, device);
  struct timespec deadline;
  deadline_after(&deadline, refill_timeout);
  pthread_mutex_lock(&lock);
  counters[0]++;
  void *found = NULL;
  for (;;) {
    found = carve(device, tag, size, stream);
    if (found == NULL && settle(device, tag, 0) >= size) {
      counters[3]++;
      settle(device, tag, 1);
    }
    if (found == NULL) found = carve(device, tag, size, stream);
    if (found != NULL || stopping) break;
    /* No room: ask the refill thread and wait (a refill or a failure bumps the generation). */
    uint64_t seen = generation[slot];
    if (want[slot] < size) want[slot] = size;
    pthread_cond_signal(&wanted);
    counters[4]++;
    int timed_out = 0;
    while (generation[slot] == seen && !stopping && !timed_out) {
      timed_out = pthread_cond_timedwait(&refilled, &lock, &deadline) == ETIMEDOUT;
    }
    if (timed_out) {
      counters[5]++;
      break;
    }
    if (failed_generation[slot] == generation[slot]) {
      counters[6]++;
      break;
    }
  }
  if (found != NULL && size > largest[slot]) largest[slot] = size;
  uint64_t target = low_water + largest[slot] + (uint64_t)((double)held[slot] * ahead_fraction);
  if (found != NULL && low_water > 0 && room[slot] < target && want[slot] == 0) {
    want[slot] = target - room[slot]; /* ahead: room before the next mallocs need it */
    pthread_cond_signal(&wanted);
  }
  pthread_mutex_unlock(&lock);
  return found;
}

void vmmd_torch_free(void *pointer, ssize_t size, int device, void *stream) {
  (void)size;
  (void)device;
  uint64_t address = (uint64_t)(uintptr_t)pointer;
  pthread_mutex_lock(&lock);
  counters[1]++;
  int known = 0;
  for (int k = 0; k < chunk_count && !known; k++) {
    chunk_t *c = &chunks[k];
    if (address < c->base || address >= c->base + c->size) continue;
    int in_use = 0;
    for (int i = 0; i < c->count; i++) {
      span_t *s = &c->spans[i];
      if (s->state == SPAN_USED && c->base + s->offset == address) {
        s->state = SPAN_HELD;
        s->stream = stream;
        s->event = NULL;
        known = 1;
      }
      if (s->state == SPAN_USED) in_use = 1;
    }
    c->last_use = now();
    if (known && !in_use) {
      c->freed = 1;
      return_wanted |= !c->asleep; /* an asleep chunk goes back once it wakes */
      pthread_cond_signal(&wanted);
    }
  }
  if (!known) counters[7]++;
  pthread_mutex_unlock(&lock);
}

/* The refill thread's side. */

void vmmd_set_tag(int tag) { current_tag = tag >= 0 && tag < MAX_TAGS ? tag : 0; }

int vmmd_get_tag(void) { return current_tag; }

/* Marks the chunks of `tag` asleep (1: no malloc carves from them, none is given back; their
 * FREE bytes leave the room) or awake (0). Returns the bytes of the chunks marked. */
uint64_t vmmd_set_asleep(int tag, int asleep) {
  uint64_t total = 0;
  pthread_mutex_lock(&lock);
  for (int k = 0; k < chunk_count; k++) {
    chunk_t *c = &chunks[k];
    if (c->tag != tag || c->asleep == !!asleep) continue;
    uint64_t free_bytes = 0;
    for (int i = 0; i < c->count; i++) free_bytes += c->spans[i].state == SPAN_FREE ? c->spans[i].size : 0;
    int slot = SLOT(c->tag, c->device);
    if (asleep) room[slot] -= free_bytes;
    else room[slot] += free_bytes;
    c->asleep = !!asleep;
    c->last_use = now();
    return_wanted |= !asleep && c->freed;
    total += c->size;
  }
  pthread_cond_signal(&wanted);
  pthread_mutex_unlock(&lock);
  return total;
}

int vmmd_add_tagged_chunk(int device, int tag, uint64_t base, uint64_t size) {
  if (device < 0 || device >= MAX_DEVICES || tag < 0 || tag >= MAX_TAGS) return -1;
  int slot = SLOT(tag, device);
  pthread_mutex_lock(&lock);
  int result = -1;
  if (chunk_count == chunk_capacity) {
    int capacity = chunk_capacity ? chunk_capacity * 2 : 16;
    chunk_t *grown = realloc(chunks, sizeof(chunk_t) * (size_t)capacity);
    if (grown != NULL) {
      chunks = grown;
      chunk_capacity = capacity;
    }
  }
  if (chunk_count < chunk_capacity) {
    chunk_t c = {device, tag, 0, base, size, NULL, 0, 0, 0, now(), 0};
    span_t whole = {0, size, SPAN_FREE, NULL, NULL};
    if (insert_span(&c, 0, whole) == 0) {
      chunks[chunk_count++] = c;
      room[slot] += size;
      held[slot] += size;
      result = 0;
    }
  }
  generation[slot]++;
  pthread_cond_broadcast(&refilled);
  pthread_mutex_unlock(&lock);
  return result;
}

int vmmd_add_chunk(int device, uint64_t base, uint64_t size) { return vmmd_add_tagged_chunk(device, 0, base, size); }

void vmmd_refill_failed_tag(int device, int tag) {
  if (device < 0 || device >= MAX_DEVICES || tag < 0 || tag >= MAX_TAGS) return;
  pthread_mutex_lock(&lock);
  failed_generation[SLOT(tag, device)] = ++generation[SLOT(tag, device)];
  pthread_cond_broadcast(&refilled);
  pthread_mutex_unlock(&lock);
}

void vmmd_refill_failed(int device) { vmmd_refill_failed_tag(device, 0); }

/* Waits up to `timeout` seconds for work: NEXT_REFILL with the device, the tag and the bytes a
 * malloc waits for (1: refill ahead), NEXT_RETURN when chunks may have emptied, NEXT_STOP, or
 * NEXT_TICK. */
int vmmd_next_tagged_request(int *device, int *tag, uint64_t *bytes, double timeout) {
  struct timespec deadline;
  deadline_after(&deadline, timeout);
  pthread_mutex_lock(&lock);
  int answer = NEXT_TICK;
  for (;;) {
    if (stopping) {
      answer = NEXT_STOP;
      break;
    }
    int d = 0;
    while (d < SLOTS && want[d] == 0) d++;
    if (d < SLOTS) {
      *device = d % MAX_DEVICES;
      *tag = d / MAX_DEVICES;
      *bytes = want[d];
      want[d] = 0;
      answer = NEXT_REFILL;
      break;
    }
    if (return_wanted) {
      return_wanted = 0;
      answer = NEXT_RETURN;
      break;
    }
    if (pthread_cond_timedwait(&wanted, &lock, &deadline) == ETIMEDOUT) break;
  }
  pthread_mutex_unlock(&lock);
  return answer;
}

int vmmd_next_request(int *device, uint64_t *bytes, double timeout) {
  int tag = 0;
  return vmmd_next_tagged_request(device, &tag, bytes, timeout);
}

/* Bytes not in use in the awake chunks of the chunk `except`'s tag and device, other than it. */
static uint64_t spare(int device, int tag, int except) {
  uint64_t total = 0;
  for (int k = 0; k < chunk_count; k++) {
    if (k == except || chunks[k].device != device || chunks[k].tag != tag || chunks[k].asleep) continue;
    for (int i = 0; i < chunks[k].count; i++) {
      if (chunks[k].spans[i].state != SPAN_USED) total += chunks[k].spans[i].size;
    }
  }
  return total;
}

/* Takes back one chunk with nothing in use: one PyTorch emptied (TAKE_FREED) while the device
 * keeps low_water bytes spare elsewhere, or one unused for `idle` seconds (TAKE_IDLE). The spare
 * bytes are the next mallocs' room: a malloc that must wait for a refill is the one case where a
 * thread holding the GIL and waiting for PyTorch's mutex costs a refill timeout. Its held blocks'
 * work may still run: the caller synchronizes the device before unmapping. Returns 1 with the
 * chunk's device, base and size, else 0. */
int vmmd_take_empty_chunk(int mode, double idle, int *device, uint64_t *base, uint64_t *size) {
  pthread_mutex_lock(&lock);
  double t = now();
  int found = 0;
  for (int k = 0; k < chunk_count && !found; k++) {
    chunk_t *c = &chunks[k];
    int in_use = c->asleep;
    for (int i = 0; i < c->count; i++) in_use |= c->spans[i].state == SPAN_USED;
    if (in_use) continue;
    if (mode == TAKE_FREED ? !c->freed || spare(c->device, c->tag, k) < low_water : idle <= 0 || t - c->last_use < idle) continue;
    int slot = SLOT(c->tag, c->device);
    for (int i = 0; i < c->count; i++) {
      if (c->spans[i].state == SPAN_FREE) room[slot] -= c->spans[i].size;
      drop_event(&c->spans[i]);
    }
    held[slot] -= c->size;
    *device = c->device;
    *base = c->base;
    *size = c->size;
    free(c->spans);
    memmove(&chunks[k], &chunks[k + 1], sizeof(chunk_t) * (size_t)(chunk_count - k - 1));
    chunk_count--;
    found = 1;
  }
  pthread_mutex_unlock(&lock);
  return found;
}

void vmmd_stop(void) {
  pthread_mutex_lock(&lock);
  stopping = 1;
  pthread_cond_broadcast(&wanted);
  pthread_cond_broadcast(&refilled);
  pthread_mutex_unlock(&lock);
}
