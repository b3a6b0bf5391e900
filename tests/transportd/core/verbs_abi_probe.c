/*
 * Layout probe: expands transportd's ABI lists (transportd/core/verbs_abi_members.h) against the REAL
 * <infiniband/verbs.h> and prints one "kind name value" line each; test_verbs_abi.py compares them with
 * transportd._core.abi_layout(), the same lists expanded against transportd/core/verbs_abi.h.
 */
#include <infiniband/verbs.h>
#include <stddef.h>
#include <stdio.h>

#include "verbs_abi_members.h"

#define MEMBER(s, m) printf("offset %s.%s %zu\nsize %s.%s %zu\n", #s, #m, offsetof(struct s, m), #s, #m, \
                            sizeof(((struct s *)0)->m));
#define SIZE(s) printf("size %s %zu\n", #s, sizeof(struct s));
#define CONST(c) printf("const %s %lld\n", #c, (long long)(c));

int main(void) {
    TPD_VERBS_ABI_MEMBERS(MEMBER)
    TPD_VERBS_ABI_SIZES(SIZE)
    TPD_VERBS_ABI_CONSTANTS(CONST)
    return 0;
}
