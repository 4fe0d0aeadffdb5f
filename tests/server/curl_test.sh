#!/usr/bin/env bash
# namm-api driven by curl on stories260K: the README's example, a stream, health and metrics (promtool), errors
# (invalid UTF-8, 431, HTTP/1.0 streaming), --allow-policies, SIGTERM draining a stream that is still running (it
# completes, then the server exits 0) and --drain-timeout cutting one, --request-timeout on a running request,
# --idle-timeout, idle connections closed oldest first, API keys (any-case scheme, 401 before a 100 Continue, 429
# after repeated failures), TLS and --tls-client-ca, and a NAMM's budget knob per request.
# Usage: curl_test.sh NAMM_API STORIES260K_DIR NAMM_TOOL
set -euo pipefail
API=$1
MODEL_DIR=$2
TOOL=$3
if [ ! -f "$MODEL_DIR/stories260K.bin" ]; then  # as the C++ tests do without ../shared: skipped (ctest: 77)
  echo "shared data $MODEL_DIR is absent (tests read ../shared; CI provides it)"
  exit 77
fi
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

# Starts namm-api with the given flags; sets PID and URL.
start() {
  rm -f "$work/out"  # the previous server's address must not be read for this one's
  "$API" --model "$MODEL_DIR/stories260K.bin" --tokenizer "$MODEL_DIR/tok512.bin" --listen 127.0.0.1:0 --threads 1 \
    --log-level warn "$@" > "$work/out" 2> "$work/err" &
  PID=$!
  for _ in $(seq 100); do
    URL=$(grep -o 'on https\?://[^ ]*' "$work/out" | cut -d' ' -f2 || true)
    [ -n "$URL" ] && return 0
    sleep 0.1
  done
  cat "$work/err"; fail "namm-api did not start"
}

echo "== the README's example"
start --max-context 4096  # room for a request long enough to be running when SIGTERM comes
out=$(curl -sS "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}')
text=$(echo "$out" | json 'd["choices"][0]["text"]')
[ -n "$text" ] || fail "no text in $out"
[ "$(echo "$out" | json 'd["usage"]["completion_tokens"]')" -le 32 ] || fail "usage: $out"
echo "   text: $text"

echo "== a stream ends with [DONE], and the pieces make the same text"
curl -sSN "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "stream": true}' > "$work/sse"
[ "$(tail -c 200 "$work/sse" | grep -c '^data: \[DONE\]')" = 1 ] || fail "no [DONE]: $(tail -c 300 "$work/sse")"
streamed=$(grep '^data: {' "$work/sse" | sed 's/^data: //' | python3 -c \
  "import json,sys; print(''.join(json.loads(l)['choices'][0]['text'] for l in sys.stdin))")
[ "$streamed" = "$text" ] || fail "streamed '$streamed' != '$text'"

echo "== a client that shuts down its sending side after its request still gets the response (nc -N, curl's peers)"
half=$(python3 - "$URL" <<'PY'
import json, socket, sys, urllib.parse
url = urllib.parse.urlparse(sys.argv[1])
body = json.dumps({"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0})
s = socket.create_connection((url.hostname, url.port))
s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
           f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
s.shutdown(socket.SHUT_WR)
reply = b""
while chunk := s.recv(65536):
    reply += chunk
head, _, payload = reply.partition(b"\r\n\r\n")
try:
    print(head.split(b"\r\n")[0].decode(), json.loads(payload)["choices"][0]["text"])
except ValueError:
    print("no answer:", reply[:200])
PY
)
[ "$half" = "HTTP/1.1 200 OK $text" ] || fail "half-closed client got: $half"

echo "== health, metrics (promtool), errors as JSON"
[ "$(curl -sS "$URL/health" | json 'd["status"]')" = ok ] || fail "health"
curl -sS "$URL/metrics" > "$work/metrics"
promtool check metrics < "$work/metrics" || fail "promtool refused the exposition"
grep -q '^namm_api_requests_total{endpoint="completions",status="200"} 3' "$work/metrics" || fail "request counter: $(grep requests_total "$work/metrics")"
grep -q '^namm_api_generated_tokens_total ' "$work/metrics" || fail "no token counter"
# Counted from zero (a series that first appears at 1 loses that increment to rate()).
for series in 'requests_dropped_total{reason="timeout"}' 'requests_dropped_total{reason="disconnected"}' \
    'connections_closed_total{limit="per_address"}' 'connections_closed_total{limit="total"}'; do
  grep -qF "namm_api_$series 0" "$work/metrics" || fail "no namm_api_$series at 0: $(grep -E 'dropped|closed' "$work/metrics")"
done
grep -q '^namm_api_request_duration_seconds_bucket{le="600"}' "$work/metrics" || fail "no bucket at the default timeout"
grep -q '^namm_api_time_to_first_token_seconds_count 3' "$work/metrics" || fail "TTFT histogram"
code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' -d '{"model":')
[ "$code" = 400 ] || fail "malformed JSON gave $code"
[ "$(json 'd["error"]["type"]' < "$work/body")" = invalid_request_error ] || fail "error object: $(cat "$work/body")"
code=$(curl -sS -o /dev/null -w '%{http_code}' -X DELETE "$URL/v1/completions")
[ "$code" = 405 ] || fail "DELETE gave $code"
# HEAD gets the head alone, and the connection then answers its next request (a body sent after a HEAD's head was
# read as the next response).
head=$(python3 - "$URL" <<'PY'
import socket, sys, urllib.parse
url = urllib.parse.urlparse(sys.argv[1])
s = socket.create_connection((url.hostname, url.port), timeout=10)
s.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
data = b""
while chunk := s.recv(65536):
    data += chunk
first, rest = data.split(b"\r\n\r\n", 1)
print(first.split()[1].decode(), rest.split()[1].decode() if rest.startswith(b"HTTP/1.1 ") else repr(rest[:40]))
PY
)
[ "$head" = "405 200" ] || fail "HEAD then GET on one connection: $head"
# What is not HTTP gets a 400 naming the problem, not a silent close.
for request in 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n' 'hello\r\n\r\n'; do
  answer=$(python3 - "$URL" "$request" <<'PY'
import socket, sys, urllib.parse
url = urllib.parse.urlparse(sys.argv[1])
s = socket.create_connection((url.hostname, url.port), timeout=10)
s.sendall(sys.argv[2].encode().decode("unicode_escape").encode())
data = b""
while chunk := s.recv(65536):
    data += chunk
print(data.split(b"\r\n", 1)[0].decode(), b"malformed HTTP request" in data)
PY
)
  [ "$answer" = "HTTP/1.1 400 Bad Request True" ] || fail "not HTTP ($request): $answer"
done
code=$(curl -sS -o /dev/null -w '%{http_code}' "$URL/v2/nothing")
[ "$code" = 404 ] || fail "unknown path gave $code"
printf '{"model": "stories260K", "prompt": "Once \xff upon", "max_tokens": 4}' > "$work/latin1.json"
code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
  --data-binary @"$work/latin1.json")
[ "$code" = 400 ] && grep -q 'not valid UTF-8 (an ill-formed byte at offset 41)' "$work/body" ||
  fail "invalid UTF-8 gave $code $(cat "$work/body")"
# The largest max_tokens: the message adds it to the prompt's tokens without overflowing into a negative count.
code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 9223372036854775807}')
[ "$code" = 400 ] && grep -q 'However, you requested 92233720368547758[0-9][0-9] tokens' "$work/body" ||
  fail "max_tokens 2^63-1 gave $code $(cat "$work/body")"
code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/health" -H "X-Big: $(head -c 20000 /dev/zero | tr '\0' a)")
[ "$code" = 431 ] || fail "20 KB of headers gave $code"
# HTTP/1.0 has no chunked encoding: a stream's events come unframed and the connection's end ends the body.
curl -sS -0 -N -D "$work/headers10" "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": true}' > "$work/sse10"
head -1 "$work/headers10" | grep -q '^HTTP/1.0 200' || fail "HTTP/1.0 stream: $(head -1 "$work/headers10")"
grep -qi '^Transfer-Encoding: chunked' "$work/headers10" && fail "chunked encoding sent to an HTTP/1.0 client"
[ "$(grep -c '^data: \[DONE\]' "$work/sse10")" = 1 ] || fail "HTTP/1.0 stream: $(cat "$work/sse10")"

echo "== a request cannot make the server hold more than its operator chose (--allow-policies)"
kill "$PID"; wait "$PID" 2>/dev/null || true
start --policy streaming:budget=64
full_policy='{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4, "namm_policy": "full"}'
code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' -d "$full_policy")
[ "$code" = 400 ] && grep -q -- "--allow-policies" "$work/body" || fail "namm_policy full on a bounded server: $code $(cat "$work/body")"
code=$(curl -sS -o /dev/null -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4, "namm_policy": "h2o:budget=32"}')
[ "$code" = 200 ] || fail "a bounded baseline was refused: $code"
# Refused once queued (the policy's options are checked as it is made): the same 400 streamed or not (a stream got
# 200 and an error event before).
for stream in false true; do
  code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "stories260K", "prompt": "Once", "max_tokens": 4, "stream": '$stream', "namm_policy": "h2o:budget=4,recent=5"}')
  [ "$code" = 400 ] && grep -q '"param":"namm_policy"\|recent' "$work/body" || fail "stream $stream, h2o recent > budget: $code $(cat "$work/body")"
done
# FastGen's budget sizes its heads' parts, but a head whose attention needs it keeps every token.
code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4, "namm_policy": "fastgen:budget=8"}')
[ "$code" = 400 ] && grep -q -- "--allow-policies" "$work/body" || fail "fastgen:budget=8 on a bounded server: $code $(cat "$work/body")"
kill "$PID"; wait "$PID" 2>/dev/null || true
start --policy streaming:budget=64 --allow-policies full,tova --max-tokens 8
code=$(curl -sS -o /dev/null -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' -d "$full_policy")
[ "$code" = 200 ] || fail "an allowed policy was refused: $code"
# A completion's default max_tokens (16) within the server's --max-tokens (it was refused as over the limit).
out=$(curl -sS "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once upon a time", "temperature": 0}')
[ "$(echo "$out" | json 'd["usage"]["completion_tokens"]')" -le 8 ] || fail "the default max_tokens under --max-tokens 8: $out"
# The error names the field the client sent (it said max_tokens to a client that sent max_completion_tokens).
code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/chat/completions" -H 'Content-Type: application/json'   -d '{"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 9}')
[ "$code" = 400 ] && [ "$(json 'd["error"]["param"]' < "$work/body")" = max_completion_tokens ] &&
  grep -q 'max_completion_tokens is 9' "$work/body" || fail "max_completion_tokens over --max-tokens: $code $(cat "$work/body")"
kill "$PID"; wait "$PID" 2>/dev/null || true

echo "== requests without a seed: another server seed at each start (printed); the same ones with --seed"
seed_of() {
  curl -sS "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "stories260K", "prompt": "Once", "max_tokens": 2}' | json 'd["namm"]["seed"]'
}
seeds=()
for flags in "" "" "--seed 5" "--seed 5"; do
  # shellcheck disable=SC2086
  start $flags
  grep -q "requests without a seed draw theirs from --seed" "$work/out" || fail "no server seed printed: $(cat "$work/out")"
  seeds+=("$(seed_of)")
  kill "$PID"; wait "$PID" 2>/dev/null || true
done
[ "${seeds[0]}" != "${seeds[1]}" ] || fail "two starts without --seed drew the same seed ${seeds[0]}"
[ "${seeds[2]}" = "${seeds[3]}" ] || fail "--seed 5 twice drew ${seeds[2]} and ${seeds[3]}"

echo "== a NAMM's budget knob per request ('default,budget=N'): a smaller budget holds fewer KV bytes"
"$TOOL" init --arch bam --seed 7 --scale 0.1 --out "$work/namm.safetensors" > /dev/null
start --policy "namm:$work/namm.safetensors" --chunk-size 64 --update-interval 64
story=$(python3 -c "print(' '.join(['Once upon a time there was a little dog named Max.'] * 30))")
cache() {  # cache SETTING: the policy, final KV tokens and peak KV bytes of a greedy answer
  curl -sS "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"stories260K\", \"prompt\": \"$story\", \"max_tokens\": 40, \"temperature\": 0, \"namm_policy\": \"$1\"}" |
    json 'd["namm"]["policy"], d["namm"]["cache"]["final_kv_tokens"], d["namm"]["cache"]["peak_kv_bytes"]'
}
small=$(cache default,budget=16)
large=$(cache default,budget=128)
echo "   budget 16: $small; budget 128: $large"
python3 - "$small" "$large" <<'PY' || fail "the budget did not bound the cache: $small / $large"
import sys
(p16, f16, b16), (p128, f128, b128) = ((p, float(f), int(b)) for p, f, b in (a.split() for a in sys.argv[1:]))
assert p16.endswith(",budget=16") and p128.endswith(",budget=128"), (p16, p128)
assert f16 <= 16 + 64 and f16 < f128, (f16, f128)
assert b16 < b128, (b16, b128)
PY
code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once", "max_tokens": 4, "namm_policy": "default,threshold=-5"}')
[ "$code" = 400 ] && grep -q -- "--allow-policies namm" "$work/body" || fail "a lower threshold per request: $code $(cat "$work/body")"
code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once", "max_tokens": 4, "namm_policy": "default,prompt=keep"}')
[ "$code" = 400 ] && grep -q -- "--allow-policies namm" "$work/body" || fail "prompt=keep per request: $code $(cat "$work/body")"
for setting in heads=own,threshold=-5 budget=16,prompt=keep; do  # neither a flag nor a budget lets them through
  code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "stories260K", "prompt": "Once", "max_tokens": 4, "namm_policy": "default,'"$setting"'"}')
  [ "$code" = 400 ] && grep -q -- "--allow-policies namm" "$work/body" || fail "default,$setting per request: $code $(cat "$work/body")"
done
# A key a NAMM does not take is refused before any file is opened (it read as part of the NAMM's file name, so a
# client made the server open files of its choosing), and no error says where the server's NAMM lies.
for setting in x=/../../etc/hostname budget=abc ratio=2 prompt=maybe; do
  code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "stories260K", "prompt": "Once", "max_tokens": 4, "namm_policy": "default,'"$setting"'"}')
  [ "$code" = 400 ] || fail "default,$setting per request: $code $(cat "$work/body")"
  if grep -q -- "$work" "$work/body"; then fail "an error names the server's NAMM's folder: $(cat "$work/body")"; fi
  case $setting in x=*) grep -qF "unknown option 'x' for namm in the cache setting 'x=/../../etc/hostname' of 'namm:" \
    "$work/body" || fail "unknown key: $(cat "$work/body")";; esac
done
base=$(cache default)
own=$(cache default,heads=own)
echo "   the server's NAMM: $base; heads=own: $own"
python3 - "$base" "$own" <<'PY' || fail "heads=own per request: $base / $own"
import sys
(p, f, b), (po, fo, bo) = ((p, float(f), int(b)) for p, f, b in (a.split() for a in sys.argv[1:]))
assert po == p + ",heads=own", (p, po)
assert fo <= f and bo <= b, (f, fo, b, bo)
PY
kill "$PID"; wait "$PID" 2>/dev/null || true

echo "== allowed, 'default,budget=16,prompt=keep' holds the whole prompt, then 16 tokens per head"
start --policy "namm:$work/namm.safetensors" --chunk-size 64 --update-interval 64 --allow-policies namm
keep=$(cache default,budget=16,prompt=keep)
echo "   budget 16, prompt=keep: $keep"
python3 - "$small" "$keep" <<'PY' || fail "prompt=keep: $small / $keep"
import sys
(p16, f16, b16), (pk, fk, bk) = ((p, float(f), int(b)) for p, f, b in (a.split() for a in sys.argv[1:]))
assert pk.endswith(",budget=16,prompt=keep"), pk
assert fk <= 16 + 64, fk       # evicted at the prompt's end and at the answer's updates
assert bk > 4 * b16, (bk, b16)  # the peak is the whole prompt (~360 tokens), not 16 + an update's 64
PY
kill "$PID"; wait "$PID" 2>/dev/null || true
start --max-context 4096

echo "== SIGTERM drains: a running stream completes, new connections are refused, exit 0"
curl -sSN "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "stream": true,
       "ignore_eos": true}' > "$work/drain" &
curl_pid=$!
while [ ! -s "$work/drain" ]; do sleep 0.01; done
kill -TERM "$PID"
grep -q '^data: \[DONE\]' "$work/drain" && fail "the stream ended before SIGTERM: the test needs a longer request"
sleep 0.2
code=$(curl -sS -o /dev/null -w '%{http_code}' "$URL/health" 2> /dev/null || true)
[ "$code" = 000 ] || fail "a new connection was answered ($code) while draining"
wait "$curl_pid" || fail "the stream broke while draining"
grep -q '^data: \[DONE\]' "$work/drain" || fail "the stream did not finish while draining"
[ "$(grep -c '"finish_reason":"length"' "$work/drain")" = 1 ] || fail "the stream was cut: $(tail -c 300 "$work/drain")"
wait "$PID" || fail "namm-api exited with $? after SIGTERM"
grep -q 'draining' "$work/out" || fail "no drain message"

echo "== --request-timeout ends a running request (not only a queued one) with 408, and frees its row"
start --max-context 4096 --request-timeout 0.25
code=$(curl -sS -o "$work/body" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "ignore_eos": true}')
[ "$code" = 408 ] && [ "$(json 'd["error"]["code"]' < "$work/body")" = request_timeout ] ||
  fail "a running request past --request-timeout gave $code $(cat "$work/body")"
grep -q "limit of 0.25 s" "$work/body" || fail "the 408 does not name the limit: $(cat "$work/body")"
curl -sS "$URL/metrics" > "$work/metrics"
grep -q '^namm_api_requests_dropped_total{reason="timeout"} 1' "$work/metrics" || fail "the timeout was not counted"
grep -q '^namm_api_requests_running 0' "$work/metrics" || fail "its row was not freed: $(grep running "$work/metrics")"
kill -TERM "$PID"
wait "$PID" || fail "namm-api exited with $? after SIGTERM"

echo "== --drain-timeout: a stream still running when it passes ends with an error event, exit 0"
start --max-context 4096 --drain-timeout 1
curl -sSN "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": true,
       "ignore_eos": true}' > "$work/cut" &
curl_pid=$!
while [ ! -s "$work/cut" ]; do sleep 0.01; done
kill -TERM "$PID"
wait "$PID" || fail "namm-api exited with $? after its drain timeout"
wait "$curl_pid" || true
grep -q '503\|shutting down\|drain' "$work/cut" || fail "the cut stream says nothing: $(tail -c 300 "$work/cut")"
grep -q '"finish_reason":"length"' "$work/cut" && fail "the stream finished although the drain timed out"

echo "== a client trickling its request a byte at a time is cut off at --idle-timeout for the whole request"
start --idle-timeout 1
port=${URL##*:}
elapsed=$(python3 - "$port" <<'PY'
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
start = time.time()
try:
    for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
        s.send(bytes([b]))
        time.sleep(0.2)
        s.setblocking(False)
        try:
            if s.recv(1) == b"":
                break
        except BlockingIOError:
            pass
        s.setblocking(True)
except OSError:
    pass
print(round(time.time() - start, 1))
PY
)
python3 -c "import sys; sys.exit(0 if float('$elapsed') < 3 else 1)" || fail "a trickling request held its connection $elapsed s"
kill -TERM "$PID"
wait "$PID" || fail "namm-api exited with $? after SIGTERM"

echo "== idle connections cannot lock clients out: the oldest idle one goes for a new one (per address, in all)"
start --max-connections 40 --max-connections-per-address 30
idle=$(python3 - "$URL" <<'PY'
import json, socket, sys, time, urllib.parse, urllib.request
url = urllib.parse.urlparse(sys.argv[1])
held = [socket.create_connection((url.hostname, url.port)) for _ in range(100)]  # they never send a byte
time.sleep(0.5)
health = urllib.request.urlopen(sys.argv[1] + "/health", timeout=30).status  # how fast: docs/serving.md
body = json.dumps({"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8}).encode()
request = urllib.request.Request(sys.argv[1] + "/v1/completions", body, {"Content-Type": "application/json"})
completion = urllib.request.urlopen(request, timeout=30).status
def closed(s):
    s.settimeout(0.2)
    try:
        return s.recv(1) == b""
    except (socket.timeout, BlockingIOError):
        return False
    except OSError:
        return True
states = [closed(s) for s in held]
# 70 closed for the held ones over 30, and one or two for /health and the completion (the second only when the
# first's connection had not ended yet)
closed_n = sum(states)
print(health, completion, "closed-70+" if closed_n in (71, 72) else f"closed {closed_n}",
      "oldest-first" if all(states[:closed_n]) and not any(states[closed_n:]) else f"order {states}")
PY
)
echo "   $idle"
[ "$idle" = "200 200 closed-70+ oldest-first" ] || fail "100 idle connections: $idle"
# Read whole, then matched: `curl | grep -q` fails under pipefail when grep exits before curl has written all.
metrics=$(curl -sS "$URL/metrics")
grep -q '^namm_api_connections_closed_total{limit="per_address"} 7[12]' <<< "$metrics" ||
  fail "closed connections not counted: $(grep connections_closed <<< "$metrics")"
# Nor can connections whose request's body never comes: they are idle until it has (they held the server's room
# for the idle timeout, /health answered 503).
slow=$(python3 - "$URL" <<'PY'
import socket, sys, time, urllib.parse, urllib.request
url = urllib.parse.urlparse(sys.argv[1])
head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
held = [socket.create_connection((url.hostname, url.port)) for _ in range(30)]
for s in held:
    s.sendall(head)
time.sleep(0.5)
try:
    print(urllib.request.urlopen(sys.argv[1] + "/health", timeout=10).status)
except Exception as e:
    print(e)
PY
)
[ "$slow" = 200 ] || fail "/health with 30 slow request bodies from its address: $slow"
kill -TERM "$PID"
wait "$PID" || fail "namm-api exited with $? after SIGTERM"

echo "== 10,000 idle connections held open cost no thread each: /health and a completion each answer within 1 s"
# Descriptors for the client's and the server's ends (this shell's limit is both processes'); fewer where the hard
# limit is lower, said in the output.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
held=$(( $(ulimit -n) - 200 < 10000 ? $(ulimit -n) - 200 : 10000 ))
start --max-connections $((held + 100)) --max-connections-per-address $((held + 100))
threads_before=$(awk '/^Threads:/ {print $2}' "/proc/$PID/status")
many=$(python3 - "$URL" "$held" "$PID" <<'PY'
import json, socket, sys, time, urllib.parse, urllib.request
url, n, pid = urllib.parse.urlparse(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
# From 127.0.0.2.., on source ports below the kernel's ephemeral range: 10,000 ephemeral ports taken here could
# include the free port another test (run beside this one by ctest -j) has just picked for its server.
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
below = low - 4000 >= 1024  # else (an unusual range) ephemeral ports after all: port 0
sources = ((f"127.0.0.{2 + k // 4000}", low - 4000 + k % 4000 if below else 0) for k in range(40000))
held = []
while len(held) < n:  # never send a byte
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past runs' TIME_WAIT on these source ports
    try:
        s.bind(next(sources))
    except OSError:  # taken: the next one
        s.close()
        continue
    s.connect((url.hostname, url.port))
    held.append(s)
def threads():
    return int(next(l.split()[1] for l in open(f"/proc/{pid}/status") if l.startswith("Threads:")))
def metric(name):
    text = urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=30).read().decode()
    return int(float(next(l.split()[-1] for l in text.splitlines() if l.startswith(name))))
deadline = time.time() + 30
while metric('namm_api_connections{state="idle"}') < n and time.time() < deadline:  # the backlog accepted
    time.sleep(0.1)
idle = metric('namm_api_connections{state="idle"}')
start = time.time()
health = urllib.request.urlopen(sys.argv[1] + "/health", timeout=30).status
health_s = time.time() - start
body = json.dumps({"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 16}).encode()
request = urllib.request.Request(sys.argv[1] + "/v1/completions", body, {"Content-Type": "application/json"})
start = time.time()
completion = urllib.request.urlopen(request, timeout=30).status
completion_s = time.time() - start
print(f"{health} {completion} idle={idle} threads={threads()} health={health_s:.3f}s completion={completion_s:.3f}s")
PY
)
echo "   $held held; threads before: $threads_before; $many"
read -r health completion idle threads health_s completion_s <<< "$many"
[ "$health $completion" = "200 200" ] || fail "with $held idle connections: $many"
[ "$idle" = "idle=$held" ] || fail "not every idle connection open: $many"
python3 -c "import sys; sys.exit(0 if float('${health_s#health=}'.rstrip('s')) < 1 and float('${completion_s#completion=}'.rstrip('s')) < 1 else 1)" ||
  fail "slower than 1 s with $held idle connections: $many"
# The io thread holds the idle ones; threads answer requests only (a few more than at start may be finishing).
[ "${threads#threads=}" -le $((threads_before + 4)) ] || fail "threads grew with idle connections: $threads_before -> $many"
kill -TERM "$PID"
wait "$PID" || fail "namm-api exited with $? after SIGTERM"

echo "== API keys: 'Bearer' in any case; no key and Expect: 100-continue: 401 before any body; then 429 for a minute"
printf 'sk-a\n' > "$work/keys_a"
start --api-keys "$work/keys_a"
for header in 'Authorization: bearer sk-a' 'Authorization: BEARER   sk-a'; do
  code=$(curl -sS -o /dev/null -w '%{http_code}' -H "$header" "$URL/v1/models")
  [ "$code" = 200 ] || fail "'$header' gave $code"
done
early=$(python3 - "$URL" <<'PY'
import socket, sys, urllib.parse
url = urllib.parse.urlparse(sys.argv[1])
s = socket.create_connection((url.hostname, url.port), timeout=5)
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          b"Expect: 100-continue\r\nContent-Length: 1000000\r\n\r\n")  # the body is never sent
reply = b""
try:
    while chunk := s.recv(65536):
        reply += chunk
except socket.timeout:
    pass
print(reply.split(b"\r\n")[0].decode(), "continue" if b"100 Continue" in reply else "no-continue")
PY
)
[ "$early" = "HTTP/1.1 401 Unauthorized no-continue" ] || fail "no key with Expect: 100-continue: $early"
codes=""
for _ in $(seq 25); do
  codes="$codes $(curl -sS -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer wrong' "$URL/v1/models")"
done
echo "   wrong keys: $codes"
case "$codes" in " 401"*" 429") ;; *) fail "wrong keys gave: $codes" ;; esac
grep -q '429.*401' <<< "$codes" && fail "a 401 after a 429: $codes"
curl -sS -D "$work/headers" -o "$work/body" -H 'Authorization: Bearer wrong' "$URL/v1/models" > /dev/null
grep -qi '^Retry-After: 60' "$work/headers" || fail "429 without Retry-After: $(cat "$work/headers")"
[ "$(json 'd["error"]["code"]' < "$work/body")" = rate_limit_exceeded ] || fail "429 body: $(cat "$work/body")"
code=$(curl -sS -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer sk-a' "$URL/v1/models")
[ "$code" = 200 ] || fail "a valid key from the locked-out address gave $code"
code=$(curl -sS -o /dev/null -w '%{http_code}' "$URL/health")
[ "$code" = 200 ] || fail "/health needs no key, gave $code"
kill -TERM "$PID"
wait "$PID" || fail "namm-api exited with $? after SIGTERM"

echo "== API keys and TLS (curl with the CA; no key: 401)"
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$work/key.pem" -out "$work/cert.pem" -days 1 \
  -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1 2> /dev/null
echo "sk-test" > "$work/keys"
start --api-keys "$work/keys" --tls-cert "$work/cert.pem" --tls-key "$work/key.pem"
case "$URL" in https://*) ;; *) fail "TLS server reports $URL" ;; esac
code=$(curl -sS --cacert "$work/cert.pem" -o "$work/body" -w '%{http_code}' "$URL/v1/models")
[ "$code" = 401 ] || fail "no key gave $code"
[ "$(json 'd["error"]["code"]' < "$work/body")" = invalid_api_key ] || fail "401 body: $(cat "$work/body")"
ids=$(curl -sS --cacert "$work/cert.pem" -H 'Authorization: Bearer sk-test' "$URL/v1/models" | json '[m["id"] for m in d["data"]]')
[ "$ids" = "['stories260K']" ] || fail "models: $ids"
curl -sS "${URL/https/http}/health" > /dev/null 2>&1 && fail "plain HTTP was answered on the TLS port"
kill -TERM "$PID"
wait "$PID" || fail "namm-api exited with $? after SIGTERM"

echo "== --tls-client-ca: only clients with a certificate from that CA are served"
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$work/ca.key" -out "$work/ca.pem" -days 1 -subj /CN=test-ca 2> /dev/null
openssl req -newkey rsa:2048 -nodes -keyout "$work/client.key" -out "$work/client.csr" -subj /CN=client 2> /dev/null
openssl x509 -req -in "$work/client.csr" -CA "$work/ca.pem" -CAkey "$work/ca.key" -CAcreateserial \
  -out "$work/client.pem" -days 1 2> /dev/null
start --tls-cert "$work/cert.pem" --tls-key "$work/key.pem" --tls-client-ca "$work/ca.pem"
curl -sS --cacert "$work/cert.pem" "$URL/health" > /dev/null 2>&1 && fail "a client without a certificate was served"
curl -sS --cacert "$work/cert.pem" --cert "$work/cert.pem" --key "$work/key.pem" "$URL/health" > /dev/null 2>&1 &&
  fail "a client with a certificate from another CA was served"
[ "$(curl -sS --cacert "$work/cert.pem" --cert "$work/client.pem" --key "$work/client.key" "$URL/health" |
  json 'd["status"]')" = ok ] || fail "a client with the CA's certificate was refused"
kill -TERM "$PID"
wait "$PID" || fail "namm-api exited with $? after SIGTERM"
echo "all passed"
