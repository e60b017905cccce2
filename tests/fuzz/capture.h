/* Included before each tests/test_api*.c when they are built for seeding the fuzz
 * corpora (Makefile, build-fuzz/capture-api): their calls of the request and
 * tool-call parsers go through capture.c, which saves every body and text
 * they are given under $KVT_FUZZ_CAPTURE/<target>/ and then calls the
 * parser. The tests run as they always do. */
#ifndef KVT_FUZZ_CAPTURE_H
#define KVT_FUZZ_CAPTURE_H

#include "serve/api.h"

int fuzz_capture_parse(kvt_request *out, kvt_api api, const char *body, size_t len, const kvt_model *m,
                       int *status);
int fuzz_capture_parse_opts(kvt_request *out, kvt_api api, const char *body, size_t len, const kvt_model *m,
                            const kvt_parse_opts *opts, int *status);
int fuzz_capture_tool_calls_parse(const char *text, size_t len, kvt_tool_call **calls, size_t *n, size_t *text_end);

#define kvt_request_parse fuzz_capture_parse
#define kvt_request_parse_opts fuzz_capture_parse_opts
#define kvt_tool_calls_parse fuzz_capture_tool_calls_parse

#endif
