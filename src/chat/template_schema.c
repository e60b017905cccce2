/* Tool-call arguments typed by the request's JSON schemas (template_impl.h).
 *
 * A call syntax that writes every value as bare text (Qwen 3.5's
 * <parameter=KEY>\nVALUE\n</parameter>) does not say whether `10` is the
 * number or the string: the function's schema in the request does. Clients
 * validate the arguments against that schema (Claude Code, Codex and the MCP
 * servers behind them), so a `string` parameter must come back a string
 * whatever its text reads as, and an `integer` one a number. Every template
 * whose syntax carries no types converts its values here, so the rules are
 * one set:
 *
 *   string                      the text as written
 *   integer, number, boolean,   the text parsed (JSON; True, False and None,
 *   null, object, array         Python's spelling the templates write, too),
 *                               when it parses as that type; else the text
 *   a list of types, anyOf,     the first alternative the text parses as
 *   oneOf                       (strings last)
 *   enum, const                 a string value the text equals; else a value
 *                               the parsed text equals; else by the types of
 *                               the values
 *   $ref                        "#/..." pointers into the tool's own schema
 *                               ($defs, definitions)
 *   properties, items           an object (array) type when no type is
 *                               given; inside a parsed object or array each
 *                               value whose type its schema does not allow
 *                               is converted the same way from its text
 *
 * A schema that types nothing (no such parameter, an empty schema) gives
 * NULL: the caller converts as it does without schemas. Schemas are the
 * client's: every walk is bounded in depth, in $ref hops and in the steps
 * one argument may take, so deep nesting, $ref cycles and huge enums cost a
 * bounded amount and type no further. */
#include "chat/template_impl.h"
#include "base/jsonstr.h"
#include "base/util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Nesting of schemas followed (anyOf in anyOf, properties in properties). */
#define SCHEMA_DEPTH 32
/* $ref hops followed in a row. */
#define SCHEMA_REFS 16
/* Schema nodes, enum values and value nodes one argument may visit. */
#define SCHEMA_STEPS (1L << 20)

enum { T_NULL = 1, T_BOOL = 2, T_INT = 4, T_NUM = 8, T_STR = 16, T_OBJ = 32, T_ARR = 64 };

typedef struct sctx {
    const json_t *root; /* the function's parameters schema: where "#" points */
    long steps;         /* left */
} sctx;

static bool step(sctx *c) { return --c->steps >= 0; }

/* The value at a local JSON pointer ("#", "#/$defs/X", ~0 and ~1 escaped). */
static const json_t *pointer(const json_t *root, const char *ref)
{
    if (ref[0] != '#') return NULL; /* another document: not followed */
    const json_t *v = root;
    const char *p = ref + 1;
    char seg[256];
    while (*p == '/' && v) {
        p++;
        size_t n = 0;
        for (; *p && *p != '/'; p++) {
            char ch = *p;
            if (ch == '~' && (p[1] == '0' || p[1] == '1')) ch = *++p == '0' ? '~' : '/';
            if (n + 1 >= sizeof seg) return NULL;
            seg[n++] = ch;
        }
        seg[n] = 0;
        if (json_is_object(v)) {
            v = json_object_get(v, seg);
        } else if (json_is_array(v)) {
            char *e;
            unsigned long i = strtoul(seg, &e, 10);
            v = n && !*e ? json_array_get(v, i) : NULL;
        } else {
            v = NULL;
        }
    }
    return *p ? NULL : v;
}

/* s with its $refs followed: an object schema, or NULL (no schema, a ref
 * that does not resolve, too many hops, out of steps). */
static const json_t *resolve(sctx *c, const json_t *s)
{
    for (int hops = 0; json_is_object(s); hops++) {
        const json_t *ref = json_object_get(s, "$ref");
        if (!json_is_string(ref)) return s;
        if (hops == SCHEMA_REFS || !step(c)) return NULL;
        s = pointer(c->root, json_string_value(ref));
    }
    return NULL;
}

static unsigned type_bit(const json_t *name)
{
    static const struct { const char *n; unsigned b; } names[] = {
        {"string", T_STR}, {"integer", T_INT}, {"number", T_NUM | T_INT}, {"boolean", T_BOOL},
        {"null", T_NULL},  {"object", T_OBJ},  {"array", T_ARR},
    };
    const char *s = json_string_value(name);
    for (size_t i = 0; s && i < sizeof names / sizeof *names; i++)
        if (!strcmp(s, names[i].n)) return names[i].b;
    return 0;
}

/* The types a JSON value is an instance of (an integral real is an integer,
 * as JSON Schema counts). */
static unsigned kind_of(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_NULL: return T_NULL;
    case JSON_TRUE:
    case JSON_FALSE: return T_BOOL;
    case JSON_INTEGER: return T_INT | T_NUM;
    case JSON_REAL: return T_NUM | (json_real_value(v) == floor(json_real_value(v)) ? T_INT : 0);
    case JSON_STRING: return T_STR;
    case JSON_OBJECT: return T_OBJ;
    default: return T_ARR;
    }
}

static const json_t *alternatives(const json_t *s)
{
    const json_t *a = json_object_get(s, "anyOf");
    return json_is_array(a) ? a : json_is_array(a = json_object_get(s, "oneOf")) ? a : NULL;
}

/* The types object schema s itself gives (type, enum, const; properties
 * or items without a type), its alternatives aside. */
static unsigned own_types(sctx *c, const json_t *s)
{
    unsigned bits = 0;
    const json_t *ty = json_object_get(s, "type"), *en = json_object_get(s, "enum"), *x;
    size_t i;
    if (json_is_string(ty)) bits |= type_bit(ty);
    json_array_foreach(json_is_array(ty) ? ty : NULL, i, x) bits |= type_bit(x);
    json_array_foreach(json_is_array(en) ? en : NULL, i, x) {
        if (!step(c)) break;
        bits |= kind_of(x);
    }
    if ((x = json_object_get(s, "const"))) bits |= kind_of(x);
    if (!bits && (json_is_object(json_object_get(s, "properties")) ||
                  json_is_object(json_object_get(s, "additionalProperties"))))
        bits = T_OBJ;
    if (!bits && (json_is_object(json_object_get(s, "items")) || json_is_array(json_object_get(s, "prefixItems"))))
        bits = T_ARR;
    return bits;
}

/* The types schema s allows; 0 when it says nothing about them. */
static unsigned allowed(sctx *c, const json_t *s, int depth)
{
    s = resolve(c, s);
    if (!s || depth > SCHEMA_DEPTH || !step(c)) return 0;
    unsigned bits = own_types(c, s);
    const json_t *x;
    size_t i;
    json_array_foreach(alternatives(s), i, x) bits |= allowed(c, x, depth + 1);
    return bits;
}

/* The text t[0, n) read as JSON (surrounding whitespace aside), Python's
 * True, False and None as JSON's; NULL when it is none. */
static json_t *read_json(const char *t, size_t n)
{
    size_t a = 0, z = n;
    kvt_tpl_trim(t, &a, &z);
    if (z - a == 4 && !memcmp(t + a, "True", 4)) return json_true();
    if (z - a == 5 && !memcmp(t + a, "False", 5)) return json_false();
    if (z - a == 4 && !memcmp(t + a, "None", 4)) return json_null();
    return z > a ? json_loadb(t + a, z - a, JSON_DECODE_ANY, NULL) : NULL;
}

static void conform(sctx *c, json_t *v, const json_t *s, int depth);

/* Text t[0, n) as a non-string value schema s allows (an enum's string
 * value the text equals: that string); NULL when it is none (then it is a
 * string, if s allows one). */
static json_t *typed(sctx *c, const json_t *s, const char *t, size_t n, int depth)
{
    s = resolve(c, s);
    if (!s || depth > SCHEMA_DEPTH || !step(c)) return NULL;
    json_t *jv = read_json(t, n);
    const json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const"), *x;
    size_t i;
    /* enum and const: a string value the text is, then a value it reads as */
    for (int pass = 0; pass < 2 && (en || cn); pass++) {
        for (i = 0; i <= json_array_size(en); i++) {
            x = i < json_array_size(en) ? json_array_get(en, i) : cn;
            if (!x || !step(c)) break;
            bool hit = pass == 0 ? json_is_string(x) && json_string_length(x) == n &&
                                       !memcmp(json_string_value(x), t, n)
                                 : jv && !json_is_string(x) && json_equal(jv, x);
            if (hit) {
                json_decref(jv);
                return pass == 0 ? json_stringn(t, n) : json_deep_copy(x);
            }
        }
    }
    if (jv && !json_is_string(jv) && (own_types(c, s) & kind_of(jv))) {
        conform(c, jv, s, depth + 1);
        return jv;
    }
    json_decref(jv);
    json_array_foreach(alternatives(s), i, x) {
        json_t *v = typed(c, x, t, n, depth + 1);
        if (v && !json_is_string(v)) return v;
        json_decref(v);
    }
    return NULL;
}

/* Text t[0, n) under schema s: typed, else the text when s allows a
 * string or allows types the text is none of; NULL when s gives no type. */
static json_t *value_of(sctx *c, const json_t *s, const char *t, size_t n, int depth)
{
    unsigned k = allowed(c, s, depth);
    if (!k) return NULL;
    json_t *v = typed(c, s, t, n, depth);
    return v ? v : json_stringn(t, n);
}

/* The schema of member key (index i for an array) of a value under s: its
 * properties entry, else additionalProperties (items, prefixItems). */
static const json_t *member_schema(sctx *c, const json_t *s, const char *key, size_t i, int depth)
{
    s = resolve(c, s);
    if (!s || depth > SCHEMA_DEPTH || !step(c)) return NULL;
    const json_t *m = NULL;
    if (key) {
        m = json_object_get(json_object_get(s, "properties"), key);
        if (!m && json_is_object(json_object_get(s, "additionalProperties")))
            m = json_object_get(s, "additionalProperties");
    } else {
        const json_t *pi = json_object_get(s, "prefixItems"), *it = json_object_get(s, "items");
        if (i < json_array_size(pi)) m = json_array_get(pi, i);
        else if (json_is_object(it)) m = it;
        else if (json_is_array(it) && i < json_array_size(it)) m = json_array_get(it, i); /* draft 4 tuples */
    }
    if (m) return m;
    const json_t *x;
    size_t k;
    json_array_foreach(alternatives(s), k, x) { /* the first alternative that knows it */
        if ((m = member_schema(c, x, key, i, depth + 1))) return m;
    }
    return NULL;
}

/* A member of a parsed value under schema s, as s types it: a value of a
 * type s does not allow converted from its text (a string's characters,
 * another scalar's JSON), objects and arrays followed inside. NULL: keep
 * it (a new reference otherwise). */
static json_t *conform_member(sctx *c, json_t *v, const json_t *s, int depth)
{
    if (!s || depth > SCHEMA_DEPTH || !step(c)) return NULL;
    unsigned k = allowed(c, s, depth);
    if (!k) return NULL;
    if (k & kind_of(v)) {
        conform(c, v, s, depth);
        return NULL;
    }
    if (json_is_object(v) || json_is_array(v)) return NULL; /* no text to read otherwise */
    char *own = json_is_string(v) ? NULL : kvt_json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    const char *t = own ? own : json_string_value(v);
    size_t n = own ? strlen(own) : json_string_length(v);
    json_t *r = t ? value_of(c, s, t, n, depth) : NULL;
    free(own);
    if (r && json_equal(r, v)) { json_decref(r); r = NULL; }
    return r;
}

/* Type the members of parsed object or array v by schema s, in place. */
static void conform(sctx *c, json_t *v, const json_t *s, int depth)
{
    if (depth > SCHEMA_DEPTH) return;
    const char *key;
    json_t *x;
    size_t i;
    json_object_foreach(json_is_object(v) ? v : NULL, key, x) {
        json_t *r = conform_member(c, x, member_schema(c, s, key, 0, depth), depth + 1);
        if (r) json_object_set_new(v, key, r); /* replaces a member: the iteration goes on */
    }
    json_array_foreach(json_is_array(v) ? v : NULL, i, x) {
        json_t *r = conform_member(c, x, member_schema(c, s, NULL, i, depth), depth + 1);
        if (r) json_array_set_new(v, i, r);
    }
}

const json_t *kvt_tpl_fn_schema(const json_t *fns, const char *name, size_t nl)
{
    size_t i;
    const json_t *f;
    json_array_foreach(json_is_array(fns) ? fns : NULL, i, f) {
        const json_t *nm = json_object_get(f, "name");
        if (json_is_string(nm) && json_string_length(nm) == nl && !memcmp(json_string_value(nm), name, nl)) {
            const json_t *p = json_object_get(f, "parameters");
            return json_is_object(p) ? p : NULL;
        }
    }
    return NULL;
}

json_t *kvt_tpl_typed_arg(const json_t *params, const char *key, const char *text, size_t n)
{
    if (!json_is_object(params) || !key || (!text && n)) return NULL;
    sctx c = {params, SCHEMA_STEPS};
    const json_t *s = member_schema(&c, params, key, 0, 0);
    return s ? value_of(&c, s, text ? text : "", n, 1) : NULL;
}
