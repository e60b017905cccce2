# kvtier build. `make` builds libkvtier.a and the kvtier binary; `make run`
# builds it and runs the main job (`kvtier run --demo`: the cache at work on
# the built-in model, README "Quick start"); `make test` builds
# and runs every test; `make asan` runs the same tests under
# AddressSanitizer + UndefinedBehaviorSanitizer in a separate build tree.
#
# Before anything is compiled, tools/deps.sh checks the Debian packages of
# tools/debian-packages (installing the missing ones when run as root) and
# the flags pkg-config gives are written to $(BUILD)/config.mk.

CC      ?= cc
PKGS    := $(shell sed -n 's/^[a-z0-9.+-]*[[:space:]]*pc:\([^[:space:]]*\)[[:space:]]*$$/\1/p' tools/debian-packages)
# -ffp-contract=off: the compiler must never fuse a*b+c on its own; every fma
# in the kernels is explicit so scalar and AVX2 paths share one rounding order.
OPT     ?= -O2 -g
SAN     ?=
CFLAGS  := $(OPT) $(SAN) -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers \
           -ffp-contract=off -fno-math-errno -Iinclude -Isrc $(PKG_CFLAGS)
LDLIBS  += $(PKG_LIBS) -lpthread -lm

BUILD   ?= build
# src/<layer>/<subject>.c: the library is every layer but app/ (the command
# line, the HTTP listener and the benchmarks), which only the binary links.
SRCS    := $(filter-out src/app/%,$(wildcard src/*/*.c))
OBJS    := $(SRCS:src/%.c=$(BUILD)/obj/%.o)
APPSRCS := $(wildcard src/app/*.c)
APPOBJS := $(APPSRCS:src/%.c=$(BUILD)/obj/%.o)
HDRS    := $(wildcard src/*/*.h include/*.h)
TSRCS   := $(wildcard tests/*.c)
TOBJS   := $(TSRCS:tests/%.c=$(BUILD)/tobj/%.o)
# The fuzz targets' bodies (tests/fuzz/, below) are in the test binary too:
# tests/test_fuzz_regress.c replays the saved inputs through them.
FSRCS   := $(filter-out $(addprefix tests/fuzz/,shim.c seedgen.c capture.c),$(wildcard tests/fuzz/*.c))
TOBJS   += $(FSRCS:tests/fuzz/%.c=$(BUILD)/tobj/fuzz/%.o)
LIB     := $(BUILD)/libkvtier.a
BIN     := $(BUILD)/kvtier
TBIN    := $(BUILD)/kvtier-tests

.PHONY: all run test asan bench peers tools clean
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

$(BUILD)/obj/%.o: src/%.c $(HDRS) | $(BUILD)/obj
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -c $< -o $@
$(BUILD)/tobj/%.o: tests/%.c $(HDRS) $(wildcard tests/*.h tests/fuzz/*.h) | $(BUILD)/tobj
	$(CC) $(CFLAGS) -c $< -o $@
$(BUILD)/tobj/fuzz/%.o: tests/fuzz/%.c $(HDRS) $(wildcard tests/fuzz/*.h) | $(BUILD)/tobj/fuzz
	$(CC) $(CFLAGS) -c $< -o $@
$(BUILD)/obj $(BUILD)/tobj $(BUILD)/tobj/fuzz:
	mkdir -p $@

$(LIB): $(OBJS)
	rm -f $@ && ar rcs $@ $^
$(BIN): $(APPOBJS) $(LIB)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)
# The tests count allocations (tests/alloc.c wraps malloc, calloc, realloc).
$(TBIN): $(TOBJS) $(LIB)
	$(CC) $(CFLAGS) -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc -o $@ $^ $(LDLIBS)

run: $(BIN)
	./$(BIN) run --demo

# The runner prints one line per test and closes with "N passed, N failed".
# T=FILE runs exactly the tests of tests/test_FILE.c (T=tokenizer: the
# tokenizer_* tests); any other T=pattern the tests whose name contains it.
# build/kvtier-tests --list [PATTERN] lists the selected names and files.
test: $(TBIN) $(BIN)
	KVT_BIN=$(BIN) ./$(TBIN) $(T)

asan:
	$(MAKE) BUILD=build-asan OPT="-O1 -g" \
	    SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" test

bench: $(BIN)
	./bench/run.sh $(BIN)

# kvtier against llama.cpp on the same files (bench/PEERS.md): builds
# llama.cpp from node-llama-cpp's source bundle with cmake in a cache dir.
peers: $(BIN)
	@tools/deps.sh peers
	./bench/peers.sh $(BIN)

# tools/store_io measures the durable-write strategies (docs/STORE.md).
tools: $(BUILD)/store_io
$(BUILD)/store_io: tools/store_io.c | $(BUILD)/obj
	$(CC) -O2 -Wall -o $@ $< $(shell pkg-config --libs sqlite3)

# libFuzzer targets (tests/fuzz/README.md): the library and the targets built
# with clang into build-fuzz/, each target run for FUZZ_SECONDS on a corpus
# in build-fuzz/corpus/<target>/ seeded from tests/fuzz/seeds/<target>/ and
# from what the engine and the tests write; fails when any target finds a
# crash, a leak, a timeout or a broken property (the input is then in
# build-fuzz/crashes/<target>/). FUZZ_TARGETS=... runs some of them.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= gguf snapshot block api_chat api_completions api_responses api_messages api_count_tokens \
                toolcall template tokenizer
FUZZ_CC      ?= clang
FB           := build-fuzz
FUZZ_CFLAGS   = -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined \
                -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers \
                -ffp-contract=off -fno-math-errno -Iinclude -Isrc $(PKG_CFLAGS)
FUZZ_OBJS    := $(SRCS:src/%.c=$(FB)/obj/%.o)
FUZZ_HOBJS   := $(FSRCS:tests/%.c=$(FB)/tobj/%.o)

.PHONY: fuzz fuzz-build fuzz-seeds
fuzz: fuzz-build fuzz-seeds
	@FUZZ_SECONDS=$(FUZZ_SECONDS) tests/fuzz/run.sh $(FB) $(FUZZ_TARGETS)
fuzz-build: $(FUZZ_TARGETS:%=$(FB)/fuzz-%)
fuzz-seeds: $(FB)/seeds/stamp

$(FB)/deps.stamp: tools/debian-packages tools/deps.sh
	@tools/deps.sh fuzz
	@mkdir -p $(FB) && touch $@
$(FB)/obj/%.o: src/%.c $(HDRS) | $(FB)/deps.stamp
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(FUZZ_COV) -c $< -o $@
FUZZ_COV     := -fsanitize=fuzzer-no-link
# The kernels are no parser: still under the sanitizers, but without the
# coverage instrumentation that slowed every forward pass several times.
$(FB)/obj/kernels/kernels.o: FUZZ_COV := -O2
$(FB)/tobj/%.o: tests/%.c $(HDRS) $(wildcard tests/*.h tests/fuzz/*.h) | $(FB)/deps.stamp
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@
$(FB)/libkvtier.a: $(FUZZ_OBJS)
	rm -f $@ && ar rcs $@ $^
$(FB)/fuzz-%: tests/fuzz/shim.c tests/fuzz/fuzz.h $(FUZZ_HOBJS) $(FB)/libkvtier.a
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -DFUZZ_ENTRY=fuzz_$* -o $@ $< $(FUZZ_HOBJS) $(FB)/libkvtier.a $(LDLIBS)
# Seeds the engine writes (GGUFs, snapshot and block records, texts) and the
# request bodies and model outputs tests/test_api*.c parse, captured as they run.
$(FB)/seedgen: $(FB)/tobj/fuzz/seedgen.o $(FUZZ_HOBJS) $(FB)/libkvtier.a
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -o $@ $^ $(LDLIBS)
CAPTURE_OBJS := $(patsubst tests/%.c,$(FB)/tobj/capture-%.o,$(wildcard tests/test_api*.c))
$(FB)/capture-api: $(CAPTURE_OBJS) $(FB)/tobj/main.o $(FB)/tobj/alloc.o $(FB)/tobj/fuzz/capture.o \
                  $(FB)/tobj/fuzz/common.o $(FB)/libkvtier.a
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc -o $@ $^ $(LDLIBS)
$(FB)/tobj/capture-%.o: tests/%.c $(HDRS) $(wildcard tests/*.h tests/fuzz/*.h) | $(FB)/deps.stamp
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -Wno-string-concatenation -fsanitize=fuzzer-no-link -include tests/fuzz/capture.h -c $< -o $@
$(FB)/seeds/stamp: $(FB)/seedgen $(FB)/capture-api $(wildcard tests/golden/*)
	rm -rf $(FB)/seeds && mkdir -p $(FB)/seeds
	$(FB)/seedgen $(FB)/seeds
	cp tests/golden/*.bin $(FB)/seeds/snapshot/
	KVT_FUZZ_CAPTURE=$(FB)/seeds $(FB)/capture-api >$(FB)/seeds/capture.log 2>&1 || \
	    { tail -n 20 $(FB)/seeds/capture.log; echo "capture-api failed (log: $(FB)/seeds/capture.log)"; exit 1; }
	touch $@

clean:
	rm -rf build build-asan
