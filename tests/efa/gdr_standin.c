/*
 * A stand-in for libgdrapi over host memory, for tests on machines without gdrdrv: the handful of gdr_*
 * functions transportd.dataplane.flag_publication.GdrCopy calls. "Pinning" records a range; "mapping" makes a second
 * virtual mapping of the same pages (mremap with old_size 0 on a MAP_SHARED mapping), so a store through
 * the mapped address shows up at the original one, as a BAR store shows up in GPU memory. Counters let a
 * test check that every pin and map was undone.
 */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#define PAGE (1ul << 16)

struct gdr { int open; };
typedef struct gdr *gdr_t;
typedef struct gdr_mh_s { unsigned long h; } gdr_mh_t;
typedef struct {
    uint64_t va, mapped_size;
    uint32_t page_size;
    uint64_t tm_cycles;
    uint32_t cycles_per_ms;
    unsigned mapped : 1, wc_mapping : 1;
    int mapping_type;
} gdr_info_v2_t;

struct pin { unsigned long addr; size_t size; void *map; };
static struct pin pins[64];
static int npins, nmaps, nopen;

int standin_pins(void) { return npins; }
int standin_maps(void) { return nmaps; }
int standin_open(void) { return nopen; }

gdr_t gdr_open(void) {
    gdr_t g = calloc(1, sizeof *g);
    if (g) nopen++;
    return g;
}

int gdr_close(gdr_t g) {
    free(g);
    nopen--;
    return 0;
}

int gdr_pin_buffer(gdr_t g, unsigned long addr, size_t size, uint64_t tok, uint32_t vas, gdr_mh_t *h) {
    if (addr % PAGE || size % PAGE) return 22; /* EINVAL: the real driver pins whole GPU pages */
    for (unsigned long i = 0; i < 64; i++)
        if (!pins[i].size) {
            pins[i] = (struct pin){addr, size, NULL};
            h->h = i + 1;
            npins++;
            return 0;
        }
    return 12;
}

int gdr_unpin_buffer(gdr_t g, gdr_mh_t h) {
    if (!h.h || !pins[h.h - 1].size || pins[h.h - 1].map) return 22; /* unmap first */
    pins[h.h - 1].size = 0;
    npins--;
    return 0;
}

int gdr_map(gdr_t g, gdr_mh_t h, void **va, size_t size) {
    struct pin *p = &pins[h.h - 1];
    if (!h.h || !p->size || size != p->size) return 22;
    void *m = mremap((void *)p->addr, 0, size, MREMAP_MAYMOVE); /* an alias of the same shared pages */
    if (m == MAP_FAILED) return 12;
    p->map = *va = m;
    nmaps++;
    return 0;
}

int gdr_unmap(gdr_t g, gdr_mh_t h, void *va, size_t size) {
    struct pin *p = &pins[h.h - 1];
    if (!h.h || p->map != va || size != p->size) return 22;
    munmap(va, size);
    p->map = NULL;
    nmaps--;
    return 0;
}

int gdr_get_info_v2(gdr_t g, gdr_mh_t h, gdr_info_v2_t *info) {
    struct pin *p = &pins[h.h - 1];
    info->va = p->addr;
    info->mapped_size = p->size;
    info->page_size = PAGE;
    info->mapped = p->map != NULL;
    info->wc_mapping = 1;
    return 0;
}
