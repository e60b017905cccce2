#!/bin/bash
# The module graph of src/: which file uses which, from the #include lines
# and from the calls (the symbols each object file takes from another, read
# with nm), with the layers in the order they may be used:
#
#   base < format < kernels < text < cache < arch < chat < session < store < serve < app
#
# A file may use files of its own layer and of the layers before it. The
# script prints every arrow that points up a layer or forms a cycle, and
# exits 1 when there is any (0 otherwise). Usage: tools/modgraph.sh [BUILD]
# (the object files of `make`, build/ by default); -v prints every arrow.
# MODGRAPH_ROOT reads another tree than the script's own (tests/test_build.c
# gives it one with an arrow up, which must fail).
set -eu
verbose=0
[ "${1:-}" = -v ] && { verbose=1; shift; }
build=${1:-build}
cd "${MODGRAPH_ROOT:-$(dirname "$0")/..}"
layers="base format kernels text cache arch chat session store serve app"
rank() { i=0; for l in $layers; do [ "$l" = "$1" ] && { echo $i; return; }; i=$((i + 1)); done; echo 99; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# arrows from the includes: src/L/F.c or .h includes "M/G.h" -> L/F uses M/G
for f in src/*/*.c src/*/*.h; do
    from=${f#src/}; from=${from%.*}
    sed -n 's/^#include "\([a-z0-9_]*\/[a-z0-9_]*\)\.h".*/\1/p' "$f" | while read -r to; do
        if [ "$to" != "$from" ]; then echo "$from $to include"; fi
    done
done >"$tmp/edges"

# arrows from the calls: an undefined symbol of one object defined by another
[ -d "$build/obj" ] || { echo "modgraph: no $build/obj (run make first)" >&2; exit 2; }
for f in src/*/*.c; do
    m=${f#src/}; m=${m%.c}; o=$build/obj/$m.o
    [ -f "$o" ] || { echo "modgraph: no $o (run make first)" >&2; exit 2; }
    nm -g --defined-only "$o" | awk -v m="$m" 'NF == 3 { print $3, m }'
done | sort -k1,1 >"$tmp/defs"
for f in src/*/*.c; do
    m=${f#src/}; m=${m%.c}; o=$build/obj/$m.o
    nm -u "$o" | awk -v m="$m" '{ print $NF, m }'
done | sort -k1,1 >"$tmp/uses"
join "$tmp/uses" "$tmp/defs" | awk '$2 != $3 { print $2, $3, "call" }' >>"$tmp/edges"
# template_impl.h and the template_*.c files are the inside of chat/template
sed -i 's#chat/template_[a-z0-9]*#chat/template#g' "$tmp/edges"
awk '$1 != $2' "$tmp/edges" | sort -u >"$tmp/e"

bad=0
awk '{ print $1, $2 }' "$tmp/e" | sort -u >"$tmp/pairs"
while read -r a b; do
    la=$(rank "${a%%/*}"); lb=$(rank "${b%%/*}")
    kinds=$(awk -v a="$a" -v b="$b" '$1 == a && $2 == b { printf "%s%s", s, $3; s = "," }' "$tmp/e")
    if [ "$lb" -gt "$la" ]; then echo "up:    $a -> $b ($kinds)"; bad=1
    elif grep -qx "$b $a" "$tmp/pairs"; then
        [[ "$a" < "$b" ]] && echo "cycle: $a <-> $b ($kinds; back: $(awk -v a="$b" -v b="$a" '$1 == a && $2 == b { printf "%s%s", s, $3; s = "," }' "$tmp/e"))"
        bad=1
    elif [ $verbose = 1 ]; then echo "       $a -> $b ($kinds)"; fi
done <"$tmp/pairs"
# longer cycles
if ! tsort "$tmp/pairs" >/dev/null 2>"$tmp/tsort"; then
    echo "a longer cycle runs through: $(grep -v 'input contains a loop' "$tmp/tsort" | sed 's/^tsort: //' | sort -u | tr '\n' ' ')"
    bad=1
fi
n=$(wc -l <"$tmp/pairs")
echo "modgraph: $n arrows between $(awk '{ print $1; print $2 }' "$tmp/pairs" | sort -u | wc -l) files; $([ $bad = 0 ] && echo 'none points up, no cycle' || echo 'see above')"
exit $bad
