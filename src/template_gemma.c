/* The Gemma templates: gemma3 (Gemma 3's template; Gemma 2's,
 * models/templates/google-gemma-2-2b-it.jinja in llama.cpp, is the same but
 * for the system message). template_impl.h lists what it shares with the
 * other template files; docs/API.md describes them. */
#include "template_impl.h"

#include <string.h>

#define GEMMA_BOS "<bos>"
#define GEMMA_START "<start_of_turn>"
#define GEMMA_END "<end_of_turn>\n"

/* gemma3, byte for byte:
 *
 *   <bos>, then per message <start_of_turn>ROLE\nTEXT<end_of_turn>\n, ROLE
 *   "model" for the assistant, else the message's role, TEXT trimmed; a first
 *   system (or developer) message is no turn: its text and "\n\n" go before
 *   the first turn's text
 *
 * then <start_of_turn>model\n. The template has no tools and no tool calls:
 * tools are not written, an assistant turn is its text (its calls are not
 * written) and a tool result a "tool" turn. It raises when the roles do not
 * alternate user, assistant, user...; kvtier renders those conversations
 * all the same, each message its own turn. A prefill (the last turn an
 * assistant's without calls) leaves out its <end_of_turn>\n and the
 * generation prompt (false). */
bool kvt_render_gemma3(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user)
{
    kvt_wbuf_puts(b, GEMMA_BOS);
    size_t i0 = ch->n && kvt_role_is_system(ch->t[0].role);
    for (size_t i = i0; i < ch->n; i++) {
        const kvt_turn *t = &ch->t[i];
        kvt_wbuf_puts(b, GEMMA_START);
        kvt_wbuf_puts(b, t->role == KVT_ROLE_ASSISTANT ? "model" : kvt_tpl_role(t->role));
        kvt_wbuf_puts(b, "\n");
        if (i == i0 && i0) {
            kvt_wbuf_put(b, ch->t[0].text, ch->t[0].len);
            kvt_wbuf_puts(b, "\n\n");
        }
        kvt_tpl_put_trim(b, t->text, t->len);
        if (i + 1 == ch->n && t->role == KVT_ROLE_ASSISTANT && !t->n_calls) return false;
        kvt_wbuf_puts(b, GEMMA_END);
    }
    kvt_wbuf_puts(b, GEMMA_START "model\n");
    return true;
}
