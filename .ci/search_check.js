// The docs site's search box, offline: Material's own search worker (from the built site) run on
// the built search index, queried; exits 1 when nothing matches.
//   node .ci/search_check.js <site dir> <query>
const fs = require('fs'), vm = require('vm'), path = require('path');
const site = process.argv[2], query = process.argv[3];
const worker = fs.readdirSync(path.join(site, 'assets/javascripts/workers')).find(f => f.endsWith('.js'));
const index = JSON.parse(fs.readFileSync(path.join(site, 'search/search_index.json')));
const messages = [];
const ctx = { console, setTimeout, clearTimeout, URL, TextEncoder, TextDecoder,
              importScripts: () => {}, location: { href: 'http://localhost/' } };
ctx.self = ctx; ctx.globalThis = ctx;
ctx.postMessage = m => messages.push(m);
let handler; ctx.addEventListener = (type, f) => { handler = f; };
vm.createContext(ctx);
vm.runInContext(fs.readFileSync(path.join(site, 'assets/javascripts/workers', worker), 'utf8'), ctx);
(async () => {
  const send = async m => { const r = handler({ data: m }); if (r && r.then) await r; };
  await send({ type: 0, data: { ...index, options: { suggest: false } } });
  await new Promise(r => setTimeout(r, 500));
  await send({ type: 2, data: query });
  await new Promise(r => setTimeout(r, 500));
  const res = messages.find(m => m.type === 3);
  if (!res) { console.log('no result; messages:', JSON.stringify(messages).slice(0, 300)); process.exit(1); }
  const items = res.data.items.flat().slice(0, 5).map(d => d.location + '  ' + d.title.replace(/<[^>]+>/g, ''));
  console.log(`${res.data.items.length} pages match "${query}":\n` + items.join('\n'));
  process.exit(res.data.items.length ? 0 : 1);
})();
