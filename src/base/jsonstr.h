/* JSON text helpers: JSON string text written by hand into a kvt_wbuf and
 * the UTF-8 check behind it, shared by the canonical JSON of api.c (tool
 * definitions and call arguments in the prompt) and by template.c (the
 * templates' `tojson` writer, the plain template's tool-call lines, the DSML
 * parser); and the one jansson dump every JSON this project sends goes
 * through. */
#ifndef KVT_JSONSTR_H
#define KVT_JSONSTR_H

#include "base/buf.h"

#include <stddef.h>

/* The body of a JSON string (no quotes) for s[0, n): only the escapes JSON
 * requires (", \, and control characters: \n \r \t \b \f, others as
 * \u00xx); every other byte as it is. */
void kvt_json_chars(kvt_wbuf *b, const char *s, size_t n);
/* The same between quotes. */
void kvt_json_string(kvt_wbuf *b, const char *s, size_t n);

struct json_t; /* jansson's */
/* A JSON string (as kvt_json_string), integer (decimal), true, false or null,
 * spelt alike by every JSON writer here; false, nothing written, for an
 * object, an array or a real (each writer's own). */
bool kvt_json_scalar(kvt_wbuf *b, const struct json_t *v);

/* Length of the well-formed UTF-8 character at s[0..n) (RFC 3629: no
 * overlongs, no surrogates, nothing past U+10FFFF, as jansson checks), or 0. */
size_t kvt_utf8_char(const unsigned char *s, size_t n);

/* jansson's json_dumps (malloc'ed, NUL-terminated; NULL when v is NULL or
 * out of memory), but never a partial text: every JSON this project sends
 * goes through it. */
char *kvt_json_dumps(const struct json_t *v, size_t flags);

#endif
