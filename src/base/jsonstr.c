/* JSON text helpers shared by the API-shape layer (api.c), the chat
 * templates (template.c) and the server; see jsonstr.h. */
#include "base/jsonstr.h"

#include <jansson.h>
#include <stdio.h>

/* The body of a JSON string (no quotes). */
void kvt_json_chars(kvt_wbuf *b, const char *s, size_t n)
{
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        kvt_wbuf_put(b, s + run, i - run);
        run = i + 1;
        char esc[8];
        switch (c) {
        case '"': kvt_wbuf_puts(b, "\\\""); break;
        case '\\': kvt_wbuf_puts(b, "\\\\"); break;
        case '\n': kvt_wbuf_puts(b, "\\n"); break;
        case '\r': kvt_wbuf_puts(b, "\\r"); break;
        case '\t': kvt_wbuf_puts(b, "\\t"); break;
        case '\b': kvt_wbuf_puts(b, "\\b"); break;
        case '\f': kvt_wbuf_puts(b, "\\f"); break;
        default:
            snprintf(esc, sizeof esc, "\\u%04x", c);
            kvt_wbuf_puts(b, esc);
        }
    }
    kvt_wbuf_put(b, s + run, n - run);
}

void kvt_json_string(kvt_wbuf *b, const char *s, size_t n)
{
    kvt_wbuf_put(b, "\"", 1);
    kvt_json_chars(b, s, n);
    kvt_wbuf_put(b, "\"", 1);
}

bool kvt_json_scalar(kvt_wbuf *b, const struct json_t *v)
{
    char num[40];
    switch (json_typeof(v)) {
    case JSON_STRING: kvt_json_string(b, json_string_value(v), json_string_length(v)); return true;
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        kvt_wbuf_puts(b, num);
        return true;
    case JSON_TRUE: kvt_wbuf_puts(b, "true"); return true;
    case JSON_FALSE: kvt_wbuf_puts(b, "false"); return true;
    case JSON_NULL: kvt_wbuf_puts(b, "null"); return true;
    default: return false;
    }
}

/* Length of the well-formed UTF-8 character at s[0..n) (RFC 3629: no
 * overlongs, no surrogates, nothing past U+10FFFF, as jansson checks), or 0. */
size_t kvt_utf8_char(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t need;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) need = 2, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) need = 3, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) need = 4, cp = c & 0x07;
    else return 0;
    if (n < need) return 0;
    for (size_t i = 1; i < need; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if (need == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) return 0;
    if (need == 4 && (cp < 0x10000 || cp > 0x10FFFF)) return 0;
    return need;
}

static int dump_put(const char *p, size_t n, void *b)
{
    kvt_wbuf_put(b, p, n);
    return ((kvt_wbuf *)b)->oom ? -1 : 0;
}

char *kvt_json_dumps(const struct json_t *v, size_t flags)
{
    /* not json_dumps: with one of its allocations failing, Debian's jansson
     * 2.14 returned an object with a key missing ({"id":"id-1",":"message"
     * ...; tests/test_api.c api_every_allocation_failure). A buffer whose
     * failure sticks fails every append after the first that fails. */
    kvt_wbuf b = {0};
    if (!v || json_dump_callback(v, dump_put, &b, flags) || (kvt_wbuf_put(&b, "", 1), b.oom)) {
        kvt_wbuf_free(&b);
        return NULL;
    }
    return (char *)b.p;
}
