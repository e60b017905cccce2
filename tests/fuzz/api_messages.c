/* api_messages: request bodies of POST /v1/messages (Anthropic), parsed as the
 * server parses them (kvt_request_parse_opts) for the deepseek template
 * (ds4-tiny) and the plain one, with the default options and with volatile
 * lines kept and a replay hook; see fuzz_request (common.c) for what must
 * hold of a parse, of a refusal and of the responses to a parsed request.
 * The templates' rendering runs inside every parse. */
#include "fuzz.h"

int fuzz_api_messages(const uint8_t *data, size_t size)
{
    fuzz_request(KVT_API_MESSAGES, data, size);
    return 0;
}
