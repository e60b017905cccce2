/* Internal hooks of the disk tier (the public API is in kvtier.h). */
#ifndef KVT_STORE_H
#define KVT_STORE_H

#include "kvtier.h"

/* Cap the database at `pages` pages, so writes fail as on a full disk
 * (tests of the save error path). */
int kvt_store_limit_pages(kvt_store *st, uint32_t pages);

#endif
