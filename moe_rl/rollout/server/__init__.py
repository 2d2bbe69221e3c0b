"""`moe-rl serve`: SGLang's native HTTP API over `LocalEngine` (CPU rollouts, tests, demos).

The JSON shapes mirror SGLang (read from the sglang 0.5.x wheel):

  POST /generate                 body: `GenerateReqInput` (sglang/srt/managers/io_struct.py):
                                 input_ids (list or list of lists) | text, sampling_params (dict or
                                 list; a key outside SGLang's contract is its 400), return_logprob,
                                 logprob_start_len, top_logprobs_num, token_ids_logprob,
                                 return_text_in_logprobs, return_routed_experts, routed_experts_start_len,
                                 rid (a string: `rid_i` per item of a batch), stream.
                                 reply: one dict per sample, {"output_ids", "meta_info", ["text"]}
                                 (TokenizerManager._handle_batch_output, sglang/srt/managers/
                                 tokenizer_manager.py); a single dict for one prompt with n == 1,
                                 else a list in prompt-major order (prompt 0 samples 0..n-1, ...),
                                 as TokenizerManager._handle_batch_request expands it. stream=true:
                                 server-sent events `data: {...}` with the text and output_ids so far
                                 (SGLang's default, cumulative), the last one the whole reply, then
                                 `data: [DONE]`; "index" per sample of a batch or of n > 1.
  meta_info                      id, finish_reason ({"type": "stop", "matched": token or stop string} |
                                 {"type": "length", "length": max_new_tokens} | {"type": "abort",
                                 "message", "status_code", "err_type"}: BaseFinishReason.to_json in
                                 sglang/srt/managers/schedule_batch.py), prompt_tokens,
                                 completion_tokens, cached_tokens, weight_version, weight_versions
                                 ([{"version", "start", "end"}] over the output tokens), num_retractions,
                                 input_token_logprobs (from logprob_start_len; the first None) and
                                 output_token_logprobs [[logprob, token_id, text or None], ...]
                                 (detokenize_logprob_tokens), input/output_top_logprobs and
                                 input/output_token_ids_logprobs when asked, routed_experts: base64 of
                                 int32 [len(prompt + output) - 1 - routed_experts_start_len,
                                 num_hidden_layers, topk] (DetokenizerManager._b64_encode_per_request;
                                 rows of dense layers are 0, as SGLang's zero-initialised capture
                                 buffer leaves them), e2e_latency.
  errors                         {"error": {"message": ...}} with status 400 (http_server.py
                                 _create_error_response); {"error": "<message>"} for a body SGLang's
                                 JSON contract refuses; 413 for a body over --max-body-mb.
  POST /abort_request            {rid, abort_all}: the live samples with that rid (prefix) end at their
                                 next step with finish_reason abort; 200, empty body.
  OpenAI                         /v1/models, /v1/completions, /v1/chat/completions (the tokenizer's chat
                                 template), /tokenize, /detokenize (and /v1/...): openai.py says which
                                 fields are supported and which are refused.
  POST /update_weights_from_disk {"model_path", "weight_version"?, "abort_all_requests"?,
                                 "flush_cache"? (default true)} -> {"success", "message",
                                 "num_paused_requests"}, 200 or 400 (UpdateWeightFromDiskReqInput /
                                 ...ReqOutput); with flush_cache under requests paused in place the
                                 weights load but the call fails, as SGLang's refused flush does.
  GET|POST /flush_cache[?timeout=s]  empties the prefix cache: 200, plain text; 400 "Flush cache failed."
                                 while requests run or are paused in place (with a timeout: waits
                                 that long for an idle engine), as SGLang.
  POST /pause_generation         {"mode": "abort" | "retract" | "in_place"} (PauseGenerationReqInput)
  POST /continue_generation      -> {"message": ..., "status": "ok"}
  GET /health                    200, empty body, without generating (503 when the engine is down).
  GET /health_generate           generates one greedy token from [0]; 200 when it (or any other
                                 forward step) completes within --health-check-timeout, else 503.
  GET /model_info                SGLang's keys (model_path, is_generation, weight_version, ...)
                                 plus moe-rl extras that SGLang leaves out: num_hidden_layers,
                                 moe_layer_ids, num_experts, num_experts_per_tok, vocab_size.
                                 /get_model_info is its deprecated alias, as in SGLang 0.5.23.
  GET /server_info               launch options (tp_size, dp_size, model_path, context_length, ...);
                                 /get_server_info is the deprecated alias.
  Distributed weight sync (the trainer is rank 0 of a process group it creates with the servers;
  `NcclSync` in weight_sync/nccl.py drives it; gloo stands in for NCCL on CPU). Replies are
  {"success", "message"}, 200 or 400, as SGLang's:
  POST /init_weights_update_group   InitWeightsUpdateGroupReqInput {master_address, master_port,
                                 rank_offset, world_size, group_name, backend}: join as rank
                                 rank_offset (one tp rank); answers once the group is formed.
  POST /destroy_weights_update_group  {group_name}
  POST /begin_weight_update, /end_weight_update   open / close the update session; a second begin
                                 or an end without begin is refused, as SGLang's scheduler does.
                                 Generation goes on during a session; each update call (and begin,
                                 end, /update_weights_from_disk) waits for the running /generate
                                 requests and holds new ones until it is done, unless generation is
                                 paused: then it loads at once and the paused samples go on under the
                                 new weights, their tokens spanning both versions (meta_info
                                 weight_versions). SGLang's model_update_lock: server/update_lock.py.
  POST /update_weights_from_distributed  UpdateWeightsFromDistributedReqInput {names, dtypes, shapes,
                                 group_name, flush_cache, abort_all_requests, weight_version,
                                 load_format}: receives rank 0's broadcast (one uint8 bucket for
                                 "flattened_bucket", else one per name), then loads it. Refused
                                 (400, nothing loaded) outside a session, for an unknown name or a
                                 wrong shape (the message names the tensor), or while released.
                                 With flush_cache while a generate call is in the engine, the
                                 weights load but the call fails, as SGLang's refused flush does.
  POST /update_weight_version    {new_version, abort_all_requests} -> {"success", "message", "new_version"}
  GET|POST /release_memory_occupation, /resume_memory_occupation   {tags?: subset of
                                 ["kv_cache", "weights", "cuda_graph"]}: 200 with a null body, as
                                 SGLang. Needs --enable-memory-saver (400 without: SGLang would
                                 free nothing). Nothing is freed on CPU, but what SGLang loses is
                                 lost: released weights become noise (kept with
                                 --enable-weights-cpu-backup), and while released /generate and
                                 /health_generate fail and weight loads are refused, as they would
                                 on a GPU. Releasing twice is a no-op; resuming what is not
                                 released is a 400 (SGLang raises there too).

Prefix cache (moe_rl/rollout/prefix_cache.py, SGLang's radix cache): a prompt that starts with tokens
already computed reuses their keys, values and routes (meta_info cached_tokens), computed by the weights of
that moment, until /flush_cache empties it; a flush is refused (400) while requests run or are paused in
place. --disable-radix-cache turns it off; --max-total-tokens bounds it (least recently used first). A run
with rollout.inflight_update=in_place launches its servers without it (launcher.radix_cache_args).
Weight-version labels follow SGLang's overlap scheduler unless --disable-overlap-schedule (local_engine.py).
Routes come back only with --enable-return-routed-experts, as SGLang's.

Differences from SGLang, on purpose: `sampling_params.sampling_seed` is always honoured (SGLang needs
--enable-deterministic-inference), and with n > 1 sample j uses seed s + j (SGLang
gives every copy the same seed); log-probs are log_softmax(logits / T) as SGLang's
(see --logprob-mode and sampler.py); sampling options that would change the distribution and are not
implemented (min_p, penalties, grammars, ...) are refused with a 400 instead of being applied.

Generation runs in one worker thread. Each /generate call is cut into chunks of at most
--max-batch samples, and every engine call takes the next chunk of each waiting call in
turn, so /health keeps answering, concurrent calls are safe and a small request waits one
chunk behind a huge one, not the whole of it. A call whose client disconnects is
cancelled: its chunks not yet in the engine are dropped. Weight updates load and validate
in another thread and swap between two decode steps.

Access (SGLang's scheme, moe_rl/rollout/auth.py): `--config FILE` with `api-key:` /
`admin-api-key:` lines makes every endpoint but /health* need `Authorization: Bearer KEY`
(the weight and control endpoints the admin key), 401 otherwise. /update_weights_from_disk
loads only from under a `--trusted-dir` (default: the directory holding --model-path); another path
is a failed load (400, {"success": false, ...}), as SGLang answers a path it cannot load. `--served-model-name` is what /server_info reports, so a trainer can tell its
own servers from whatever else answers on the port.

Modules: `common` (the app's keys, limits, field checks), `protocol` (/generate in and out),
`generate` (/generate, its stream, /abort_request), `openai` (the OpenAI endpoints, /tokenize), `live`
(the requests by rid), `batcher`, `updates`
(distributed weight updates), `app` (the routes, `make_app`), `thread` (`ServerThread`), `cli` (`moe-rl serve`).
"""
from __future__ import annotations

from moe_rl.rollout.server.app import ROUTES, make_app, model_info, server_info
from moe_rl.rollout.server.cli import add_arguments, run
from moe_rl.rollout.server.common import DEFAULT_PORT
from moe_rl.rollout.server.thread import ServerThread

__all__ = ["DEFAULT_PORT", "ROUTES", "ServerThread", "add_arguments", "make_app", "model_info",
           "run", "server_info"]
