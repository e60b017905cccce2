# kvtier build. `make` builds libkvtier.a and the kvtier binary; `make test`
# builds and runs every test; `make asan` runs the same tests under
# AddressSanitizer + UndefinedBehaviorSanitizer in a separate build tree.

CC      ?= cc
PKGS    := libpcre2-8 jansson libxxhash sqlite3 libmicrohttpd
# -ffp-contract=off: the compiler must never fuse a*b+c on its own; every fma
# in the kernels is explicit so scalar and AVX2 paths share one rounding order.
OPT     ?= -O2 -g
SAN     ?=
CFLAGS  := $(OPT) $(SAN) -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers \
           -ffp-contract=off -fno-math-errno -Iinclude -Isrc \
           $(shell pkg-config --cflags $(PKGS))
LDLIBS  += $(shell pkg-config --libs $(PKGS)) -lpthread -lm

BUILD   ?= build
SRCS    := $(filter-out src/cli.c,$(wildcard src/*.c))
OBJS    := $(SRCS:src/%.c=$(BUILD)/obj/%.o)
TSRCS   := $(wildcard tests/*.c)
TOBJS   := $(TSRCS:tests/%.c=$(BUILD)/tobj/%.o)
LIB     := $(BUILD)/libkvtier.a
BIN     := $(BUILD)/kvtier
TBIN    := $(BUILD)/kvtier-tests

.PHONY: all test asan bench tools clean
all: $(BIN)

$(BUILD)/obj/%.o: src/%.c $(wildcard src/*.h include/*.h) | $(BUILD)/obj
	$(CC) $(CFLAGS) -c $< -o $@
$(BUILD)/tobj/%.o: tests/%.c $(wildcard src/*.h include/*.h tests/*.h) | $(BUILD)/tobj
	$(CC) $(CFLAGS) -c $< -o $@
$(BUILD)/obj $(BUILD)/tobj:
	mkdir -p $@

$(LIB): $(OBJS)
	rm -f $@ && ar rcs $@ $^
$(BIN): $(BUILD)/obj/cli.o $(LIB)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)
$(TBIN): $(TOBJS) $(LIB)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

# The runner prints one line per test and closes with "N passed, N failed".
# T=pattern selects tests by substring.
test: $(TBIN) $(BIN)
	KVT_BIN=$(BIN) ./$(TBIN) $(T)

asan:
	$(MAKE) BUILD=build-asan OPT="-O1 -g" \
	    SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" test

bench: $(BIN)
	./bench/run.sh $(BIN)

# tools/store_io measures the durable-write strategies (docs/STORE.md).
tools: $(BUILD)/store_io
$(BUILD)/store_io: tools/store_io.c | $(BUILD)/obj
	$(CC) -O2 -Wall -o $@ $< $(shell pkg-config --libs sqlite3)

clean:
	rm -rf build build-asan
