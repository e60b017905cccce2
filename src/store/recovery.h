/* Damage recovery of the disk tier (recovery.c), inside src/store/ only. */
#ifndef KVT_STORE_RECOVERY_H
#define KVT_STORE_RECOVERY_H

#include "kvtier.h"

#include <stdbool.h>

/* SQLite reported st's database damaged: build a new database from what
 * still reads and checks out, move the damaged file aside, put the new
 * one in its place and go on with it (or follow the one another process
 * built meanwhile). KVT_OK when the store has a database again. */
int kvt_recovery_rebuild(kvt_store *st);

/* After a step of an operation failed: when SQLite found the database
 * damaged, rebuild it; true when the caller should run the step again. */
bool kvt_recovery_retry(kvt_store *st);

#endif
