# Sourced by bench/draft.sh and bench/draft_peer.sh (POSIX sh): the two
# prompts speculative decoding is measured on. copy: a C function to repeat
# with one rename (a copy-heavy agent reply); free: a story's start (free
# text, where drafts mostly miss).
# shellcheck disable=SC2034 # read by the caller
copy="Repeat the following file exactly, but rename the function parse_opts to parse_options.

static int parse_opts(int argc, char **argv, opt *o, size_t no)
{
    for (int i = 2; i < argc; i++) {
        opt *f = find(o, no, argv[i]);
        if (!f) {
            fprintf(stderr, \"kvtier: unknown argument '%s'\\\\n\", argv[i]);
            return -1;
        }
        if (f->flag) { f->val = \"1\"; continue; }
        if (i + 1 == argc) {
            fprintf(stderr, \"kvtier: %s needs a value\\\\n\", argv[i]);
            return -1;
        }
        f->val = argv[++i];
    }
    return 0;
}

Here is the file with the change:
"
free="Once upon a time, in a small village at the edge of a great forest, there lived a girl who"
