# kvtier build. `make` builds libkvtier.a and the kvtier binary; `make run`
# builds it and runs the main job with the built-in model; `make test` builds
# and runs every test; `make asan` runs the same tests under
# AddressSanitizer + UndefinedBehaviorSanitizer in a separate build tree.
#
# Before anything is compiled, tools/deps.sh checks the Debian packages of
# tools/debian-packages (installing the missing ones when run as root) and
# the flags pkg-config gives are written to $(BUILD)/config.mk.

CC      ?= cc
PKGS    := $(shell sed -n 's/^[a-z0-9.+-]*[[:space:]]*pc://p' tools/debian-packages)
# -ffp-contract=off: the compiler must never fuse a*b+c on its own; every fma
# in the kernels is explicit so scalar and AVX2 paths share one rounding order.
OPT     ?= -O2 -g
SAN     ?=
CFLAGS  := $(OPT) $(SAN) -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers \
           -ffp-contract=off -fno-math-errno -Iinclude -Isrc $(PKG_CFLAGS)
LDLIBS  += $(PKG_LIBS) -lpthread -lm

BUILD   ?= build
SRCS    := $(filter-out src/cli.c,$(wildcard src/*.c))
OBJS    := $(SRCS:src/%.c=$(BUILD)/obj/%.o)
TSRCS   := $(wildcard tests/*.c)
TOBJS   := $(TSRCS:tests/%.c=$(BUILD)/tobj/%.o)
LIB     := $(BUILD)/libkvtier.a
BIN     := $(BUILD)/kvtier
TBIN    := $(BUILD)/kvtier-tests

.PHONY: all run test asan bench tools clean
all: $(BIN)

# make reads config.mk after (re)making it, so a build that lacks a package
# stops here with the package's name, not with a compiler error.
ifeq ($(filter clean,$(MAKECMDGOALS)),)
include $(BUILD)/config.mk
endif
$(BUILD)/config.mk: tools/debian-packages tools/deps.sh Makefile
	@tools/deps.sh
	@mkdir -p $(BUILD)
	@{ echo "PKG_CFLAGS := $$(pkg-config --cflags $(PKGS))" && \
	   echo "PKG_LIBS := $$(pkg-config --libs $(PKGS))"; } >$@.tmp && mv $@.tmp $@

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

run: $(BIN)
	./$(BIN) run --prompt "Hello"

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
