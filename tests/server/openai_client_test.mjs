// namm-api driven by the official OpenAI client (npm `openai`, installed by scripts/install-deps.sh) on the real
// stories260K model: completions and chat completions, whole and streamed, the per-request policy and the cache
// report, errors as the client raises them, and the edges (queue full, limits, time limit, a client that leaves).
// Usage: node openai_client_test.mjs NAMM_API NAMM_WORKER STORIES260K_DIR
import assert from "node:assert/strict";
import { spawn, execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import OpenAI from "openai";

const [api, worker, modelDir] = process.argv.slice(2);
if (!existsSync(join(modelDir, "stories260K.bin"))) {  // as the C++ tests do without ../shared: skipped (ctest: 77)
  console.log(`shared data ${modelDir} is absent (tests read ../shared; CI provides it)`);
  process.exit(77);
}
const modelFlags = ["--model", join(modelDir, "stories260K.bin"), "--tokenizer", join(modelDir, "tok512.bin")];
const dir = mkdtempSync(join(tmpdir(), "namm-api-test-"));
const keys = join(dir, "keys");
writeFileSync(keys, "# test keys\nsk-first\n  sk-second  \n");

// Starts namm-api on a free port; resolves with {process, url} once it prints where it serves.
function startServer(extra) {
  return new Promise((resolve, reject) => {
    const child = spawn(api, [...modelFlags, "--listen", "127.0.0.1:0", "--served-model-name", "stories260K",
                              "--threads", "1", "--log-level", "warn", ...extra], { stdio: ["ignore", "pipe", "inherit"] });
    let out = "";
    child.stdout.on("data", (d) => {
      out += d;
      const m = out.match(/ on (http:\/\/[^ \n]+)/);
      if (m) resolve({ process: child, url: m[1] });
    });
    child.on("exit", (code) => reject(new Error(`namm-api exited with ${code}: ${out}`)));
  });
}

function stop(server) {
  return new Promise((resolve) => {
    server.process.removeAllListeners("exit");
    server.process.on("exit", (code, signal) => resolve({ code, signal }));
    server.process.kill("SIGTERM");
  });
}

async function metric(url, name) {
  const text = await (await fetch(url + "/metrics")).text();
  const line = text.split("\n").find((l) => l.startsWith(name + " ") || l.startsWith(name + "{"));
  return line === undefined ? 0 : Number(line.split(" ").pop());
}

async function collect(stream) {
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  return chunks;
}

const prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.";
let failures = 0;
async function check(name, body) {
  try {
    await body();
    console.log(`ok   ${name}`);
  } catch (e) {
    failures++;
    console.log(`FAIL ${name}\n${e.stack}`);
  }
}

// Memory updates every 64 tokens, in chunks of 32: the interruption task's setting for this 512-token model.
const main = await startServer(["--api-keys", keys, "--max-running", "4", "--chunk-size", "32", "--update-interval", "64"]);
const client = new OpenAI({ baseURL: main.url + "/v1", apiKey: "sk-second", maxRetries: 0 });

await check("models lists the served model", async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), ["stories260K"]);
  assert.equal((await client.models.retrieve("stories260K")).id, "stories260K");
});

let greedy;
await check("a greedy completion is what namm-worker generate writes", async () => {
  greedy = await client.completions.create({ model: "stories260K", prompt, max_tokens: 24, temperature: 0 });
  const expected = execFileSync(worker, ["generate", ...modelFlags, "--prompt", prompt, "--max-new-tokens", "24",
                                         "--threads", "1", "--chunk-size", "32", "--update-interval", "64"]).toString().replace(/\n$/, "");
  // The completion continues the prompt (prompt + text is the whole text), so it keeps the space its first token
  // carries; generate writes the answer alone, decoded as the reference decodes it.
  assert.equal(greedy.choices[0].text, " " + expected);
  assert.ok(greedy.choices[0].text.length > 0);
  assert.equal(greedy.object, "text_completion");
  assert.equal(greedy.usage.completion_tokens, 24);
  assert.equal(greedy.choices[0].finish_reason, "length");
  assert.equal(greedy.usage.total_tokens, greedy.usage.prompt_tokens + 24);
  // The full cache keeps every token: relative cache 1, nothing evicted.
  assert.equal(greedy.namm.policy, "full");
  assert.ok(Math.abs(greedy.namm.cache.relative_cache - 1) < 1e-9, JSON.stringify(greedy.namm));
  assert.equal(greedy.namm.cache.evicted_tokens, 0);
});

await check("streaming gives the same text, piece by piece, then the usage", async () => {
  const chunks = await collect(await client.completions.create({ model: "stories260K", prompt, max_tokens: 24,
    temperature: 0, stream: true, stream_options: { include_usage: true } }));
  const text = chunks.map((c) => c.choices[0]?.text ?? "").join("");
  assert.equal(text, greedy.choices[0].text);
  // In pieces: how many depends on how the server's threads are scheduled (24 tokens take a few milliseconds, and
  // a piece carries all the text made since the last), so a longer answer is counted.
  const long = await collect(await client.completions.create({ model: "stories260K", prompt, max_tokens: 400,
    temperature: 0, stream: true }));
  const pieces = long.filter((c) => (c.choices[0]?.text ?? "") !== "").length;
  assert.ok(pieces > 5, `${pieces} pieces of text`);
  const finish = chunks.filter((c) => c.choices[0]?.finish_reason);
  assert.equal(finish.length, 1);
  assert.equal(finish[0].choices[0].finish_reason, "length");
  assert.deepEqual(chunks.at(-1).usage, greedy.usage);
});

await check("the per-request policy evicts, and the response says how much", async () => {
  const long = Array(6).fill(prompt).join(" ");
  const full = await client.completions.create({ model: "stories260K", prompt: long, max_tokens: 16, temperature: 0 });
  const kept = await client.completions.create({ model: "stories260K", prompt: long, max_tokens: 16, temperature: 0,
                                                 namm_policy: "streaming:budget=32" });
  assert.equal(kept.namm.policy, "streaming:budget=32");
  // 32 kept at each memory update, and up to 64 more until the next one.
  assert.ok(kept.namm.cache.final_kv_tokens <= 32 + 64, JSON.stringify(kept.namm));
  assert.ok(kept.namm.cache.peak_kv_tokens <= 32 + 64, JSON.stringify(kept.namm));
  assert.ok(full.namm.cache.peak_kv_tokens > 200, JSON.stringify(full.namm));
  assert.ok(kept.namm.cache.relative_cache < 0.6 * full.namm.cache.relative_cache, JSON.stringify(kept.namm));
  assert.ok(kept.namm.cache.peak_kv_bytes < full.namm.cache.peak_kv_bytes);
  assert.ok(kept.namm.cache.evicted_tokens > 100);
  const metrics = await (await fetch(main.url + "/metrics")).text();
  assert.match(metrics, /namm_api_evicted_tokens_total \d+/);
});

await check("a stop string ends the answer before it, streamed or not", async () => {
  const stop = " " + greedy.choices[0].text.trim().split(" ")[3];  // the answer's fourth word
  const cut = greedy.choices[0].text.indexOf(stop);
  assert.ok(cut > 0, greedy.choices[0].text);
  const whole = await client.completions.create({ model: "stories260K", prompt, max_tokens: 24, temperature: 0,
                                                  stop: [stop, "never"] });
  assert.equal(whole.choices[0].text, greedy.choices[0].text.slice(0, cut));
  assert.equal(whole.choices[0].finish_reason, "stop");
  const chunks = await collect(await client.completions.create({ model: "stories260K", prompt, max_tokens: 24,
    temperature: 0, stop: [stop, "never"], stream: true }));
  assert.equal(chunks.map((c) => c.choices[0]?.text ?? "").join(""), whole.choices[0].text);
});

let chat;
await check("a chat completion, whole and streamed", async () => {
  const messages = [{ role: "system", content: "You tell stories." }, { role: "user", content: "Tell me about Lily." }];
  chat = await client.chat.completions.create({ model: "stories260K", messages, max_tokens: 20, temperature: 0 });
  assert.equal(chat.object, "chat.completion");
  assert.equal(chat.choices[0].message.role, "assistant");
  assert.ok(chat.choices[0].message.content.length > 0);
  const chunks = await collect(await client.chat.completions.create({ model: "stories260K", messages, max_tokens: 20,
                                                                       temperature: 0, stream: true }));
  assert.equal(chunks[0].choices[0].delta.role, "assistant");
  assert.equal(chunks.map((c) => c.choices[0]?.delta?.content ?? "").join(""), chat.choices[0].message.content);
  assert.equal(chunks.at(-1).choices[0].finish_reason, chat.choices[0].finish_reason);
});

await check("a seeded sample is the same alone and among 8 at once", async () => {
  const ask = (seed) => client.completions.create({ model: "stories260K", prompt, max_tokens: 32, temperature: 1, seed });
  const alone = [];
  for (let seed = 0; seed < 8; seed++) alone.push((await ask(seed)).choices[0].text);
  const together = (await Promise.all([...Array(8).keys()].map(ask))).map((r) => r.choices[0].text);
  assert.deepEqual(together, alone);
  assert.ok(new Set(alone).size > 1, "different seeds sample different texts");
});

await check("errors arrive as the client's error classes", async () => {
  await assert.rejects(client.completions.create({ model: "gpt-4", prompt, max_tokens: 4 }),
                       (e) => e instanceof OpenAI.NotFoundError && e.code === "model_not_found");
  await assert.rejects(client.completions.create({ model: "stories260K", prompt, max_tokens: 100000 }),
                       (e) => e instanceof OpenAI.BadRequestError && /maximum context length is 512/.test(e.message) &&
                              e.code === "context_length_exceeded");
  await assert.rejects(client.completions.create({ model: "stories260K", prompt, max_tokens: 4, n: 3 }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === "n");
  await assert.rejects(client.completions.create({ model: "stories260K", prompt, namm_policy: "namm:/etc/passwd" }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === "namm_policy");
  const stranger = new OpenAI({ baseURL: main.url + "/v1", apiKey: "sk-wrong", maxRetries: 0 });
  await assert.rejects(stranger.models.list(), (e) => e instanceof OpenAI.AuthenticationError);
});

// A second server with tight limits: one row, one queue place, a 1 s time limit, a long context to fill it.
const tight = await startServer(["--max-running", "1", "--max-queue", "1", "--request-timeout", "1",
                                 "--max-context", "4096", "--max-prompt-tokens", "200", "--max-body-bytes", "4096"]);
const tightClient = new OpenAI({ baseURL: tight.url + "/v1", apiKey: "none", maxRetries: 0 });

await check("a client that leaves frees its row at once", async () => {
  const stream = await tightClient.completions.create({ model: "stories260K", prompt, max_tokens: 3900, temperature: 0,
                                                        stream: true, ignore_eos: true });
  let pieces = 0;
  for await (const chunk of stream) {
    if (++pieces === 3) break;  // leaving the loop aborts the request
  }
  const left = Date.now();
  while ((await metric(tight.url, "namm_api_requests_running")) !== 0) {
    assert.ok(Date.now() - left < 1500, "the row was not freed");
    await new Promise((r) => setTimeout(r, 20));
  }
  assert.equal(await metric(tight.url, 'namm_api_requests_dropped_total{reason="disconnected"}'), 1);
});

await check("a full queue answers 429 with Retry-After; late requests 408", async () => {
  const long = (i) => tightClient.completions.create({ model: "stories260K", prompt, max_tokens: 3900, temperature: 0, seed: i,
                                                       ignore_eos: true });
  const results = await Promise.allSettled([long(1), long(2), long(3)]);
  const statuses = results.map((r) => (r.status === "fulfilled" ? 200 : r.reason.status)).sort();
  assert.ok(statuses.includes(429), JSON.stringify(statuses));
  const busy = results.find((r) => r.status === "rejected" && r.reason.status === 429).reason;
  assert.ok(Number(busy.headers.get("retry-after")) >= 1);
  assert.ok(statuses.includes(408), `the queued request waits longer than 1 s: ${JSON.stringify(statuses)}`);
});

await check("limits are 400s and 413s naming the limit", async () => {
  await assert.rejects(tightClient.completions.create({ model: "stories260K", prompt: Array(20).fill(prompt).join(" "), max_tokens: 4 }),
                       (e) => e.status === 400 && /--max-prompt-tokens/.test(e.message));
  const big = await fetch(tight.url + "/v1/completions", { method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: "stories260K", prompt: "x".repeat(5000) }) });
  assert.equal(big.status, 413);
  assert.match((await big.json()).error.message, /--max-body-bytes/);
});

for (const server of [main, tight]) {
  const { code } = await stop(server);
  if (code !== 0) {
    failures++;
    console.log(`FAIL namm-api exited with ${code} after SIGTERM`);
  }
}
rmSync(dir, { recursive: true, force: true });
console.log(failures === 0 ? "all passed" : `${failures} failed`);
process.exit(failures === 0 ? 0 : 1);
