/* The sampler's greedy choice and test switch (sampler.c; its API is in
 * kvtier.h). */
#ifndef KVT_SAMPLER_H
#define KVT_SAMPLER_H

/* Tests: KVT_SAMPLER_FAULT_SIGNED_ZERO orders a logit of -0 after one of
 * +0 instead of tying them (the lowest id first); KVT_SAMPLER_FAULT_GREEDY_LAST
 * makes greedy sampling take the highest id among equal largest logits. */
enum { KVT_SAMPLER_FAULT_SIGNED_ZERO = 1, KVT_SAMPLER_FAULT_GREEDY_LAST };
extern int kvt_sampler_fault;

#include <stdint.h>

/* Greedy: the lowest id of the largest of V logits (-0 equals +0; NaNs
 * never taken, unless at id 0), as the loop `if (x[i] > x[best]) best = i`
 * from best = 0 chooses; 0 when V < 2. */
uint32_t kvt_sampler_greedy(const float *x, uint32_t V);

#endif
