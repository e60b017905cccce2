/* The benchmark subcommand (kvtier bench): speed as ratios against a baseline
 * measured in the same run, cache size and peak memory per context. */
#ifndef KVT_BENCH_H
#define KVT_BENCH_H

/* argv holds the arguments after "kvtier bench". Returns the exit status:
 * 0 done, 1 runtime failure (kvt_errmsg() printed), 2 bad arguments. */
int kvt_bench_main(int argc, char **argv);

#endif
