// Reads a Chrome trace JSON with Chrome DevTools' own trace engine (the Performance panel's parser, npm
// @paulirish/trace_engine) and prints what it found as JSON: every process and thread it named, the
// complete events it placed on each thread (as its timeline would draw them), and its warnings.
// Usage: node trace_reader.mjs ENGINE_DIR TRACE.json
import path from 'node:path';
import {pathToFileURL} from 'node:url';

const [engineDir, tracePath] = process.argv.slice(2);
const {analyzeTrace} = await import(pathToFileURL(path.join(engineDir, 'analyze-trace.mjs')).href);
const {parsedTrace} = await analyzeTrace(tracePath);
const renderer = parsedTrace.data.Renderer;
const processes = {};
for (const [pid, proc] of renderer.processes) {
  const threads = {};
  for (const [tid, thread] of proc.threads) {
    threads[tid] = {
      name: thread.name ?? null,
      roots: thread.tree ? thread.tree.roots.size : null,
      entries: thread.entries.map(e => ({name: e.name, ph: e.ph, ts: e.ts, dur: e.dur ?? null})),
    };
  }
  processes[pid] = {threads};
}
const warnings = {};
for (const [kind, events] of parsedTrace.data.Warnings.perWarning) warnings[kind] = events.length;
const names = Object.fromEntries([...parsedTrace.data.Meta.processNames].map(([pid, e]) => [pid, e.args.name]));
console.log(JSON.stringify({processes, processNames: names, warnings}));
