"""A scene as a self-contained HTML page (inline SVG, style and script; no network) whose side panel
shows the full spec of whatever is hovered or clicked."""

from __future__ import annotations

import json

from .scene import Scene
from .svg import _esc, scene_svg

_CSS = """
body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1F2328; background: #FFFFFF; }
main { display: flex; align-items: flex-start; }
#picture { flex: 1 1 auto; overflow: auto; padding: 8px; }
#picture svg { display: block; max-width: none; }
#picture [data-id] { cursor: pointer; outline: none; }
#picture .node:hover, #picture .cell:hover { filter: drop-shadow(0 0 3px #8AB4F8); }
#picture .edge:hover polyline:not(.hit) { stroke-width: 3; }
#picture .selected { filter: drop-shadow(0 0 4px #1A73E8); }
#picture .edge.selected polyline:not(.hit) { stroke: #1A73E8; stroke-width: 3; }
#panel { flex: 0 0 400px; position: sticky; top: 0; max-height: 100vh; overflow: auto; box-sizing: border-box;
         padding: 12px 16px; border-left: 1px solid #D0D7DE; background: #F6F8FA; }
#panel h2 { font-size: 16px; margin: 0 0 4px; }
#panel .hint { color: #57606A; font-size: 12px; margin: 0 0 10px; }
#details h3 { font: bold 14px "DejaVu Sans Mono", Menlo, Consolas, monospace; overflow-wrap: anywhere; margin: 8px 0; }
#details h4 { font-size: 13px; margin: 12px 0 4px; }
#details h4.alert { color: #C81E1E; }
#details table { border-collapse: collapse; width: 100%; table-layout: fixed;
                 font: 12px "DejaVu Sans Mono", Menlo, Consolas, monospace; }
#details th { width: 11.5em; text-align: left; vertical-align: top; padding: 2px 10px 2px 0; color: #57606A;
              font-weight: normal; overflow-wrap: anywhere; }
#details td { padding: 2px 0; overflow-wrap: anywhere; }
#summary { padding-left: 18px; margin: 0; font-size: 13px; }
"""

_JS = """
(function () {
  "use strict";
  var info = JSON.parse(document.getElementById("viz-data").textContent);
  var details = document.getElementById("details");
  var summary = details.cloneNode(true);
  var items = Array.prototype.slice.call(document.querySelectorAll("#picture [data-id]"));
  var pinned = null;

  function element(tag, text, cls) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    if (cls) { node.className = cls; }
    return node;
  }
  function table(rows) {
    var body = element("table");
    rows.forEach(function (row) {
      var line = element("tr");
      line.appendChild(element("th", row[0]));
      line.appendChild(element("td", row[1]));
      body.appendChild(line);
    });
    return body;
  }
  function show(id) {
    var item = info[id];
    if (!item) { return; }
    details.textContent = "";
    details.appendChild(element("h3", item.title));
    if (item.rows && item.rows.length) { details.appendChild(table(item.rows)); }
    (item.sections || []).forEach(function (section) {
      details.appendChild(element("h4", section.heading, section.alert ? "alert" : ""));
      details.appendChild(table(section.rows));
    });
    details.setAttribute("data-showing", id);
  }
  function release() {
    if (pinned) { pinned.classList.remove("selected"); }
    pinned = null;
  }
  function reset() {
    release();
    details.replaceChildren.apply(details, Array.prototype.slice.call(summary.cloneNode(true).childNodes));
    details.removeAttribute("data-showing");
  }
  function pin(g) {
    release();
    pinned = g;
    g.classList.add("selected");
    show(g.getAttribute("data-id"));
  }
  items.forEach(function (g) {
    var id = g.getAttribute("data-id");
    g.addEventListener("mouseenter", function () { if (!pinned) { show(id); } });
    g.addEventListener("focus", function () { if (!pinned) { show(id); } });
    g.addEventListener("click", function (event) {
      event.stopPropagation();
      if (pinned === g) { release(); } else { pin(g); }
    });
    g.addEventListener("keydown", function (event) {
      if (event.key === "Enter" || event.key === " ") { event.preventDefault(); pin(g); }
    });
  });
  document.addEventListener("keydown", function (event) { if (event.key === "Escape") { reset(); } });
  var wanted = decodeURIComponent(window.location.hash.slice(1));
  items.forEach(function (g) { if (wanted && g.getAttribute("data-id") === wanted) { pin(g); } });
  document.body.setAttribute("data-ready", "1");
})();
"""


def scene_html(scene: Scene) -> str:
    """A self-contained page: the SVG, a details panel and a small inline script.

    Nothing is fetched (a Content-Security-Policy forbids it).  Hovering, focusing or
    clicking a node, an edge or a block shows its ``info`` in the panel; a click pins it;
    ``#<id>`` in the address pins that item on load; the script sets ``data-ready="1"``
    on ``<body>`` when it has run.

    Examples
    --------
    >>> page = scene_html(Scene(10, 10, [], title="t", summary=["no violations"]))
    >>> page.startswith("<!DOCTYPE html>"), '<li>no violations</li>' in page, "src=" in page or "href=" in page
    (True, True, False)
    """
    data = json.dumps(scene.info, sort_keys=True, ensure_ascii=True)
    data = data.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    summary = "\n".join(f"<li>{_esc(line)}</li>" for line in scene.summary)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; \
script-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_esc(scene.title)}</title>
<style>{_CSS}</style>
</head>
<body data-ready="0">
<main>
<div id="picture">
{scene_svg(scene)}</div>
<aside id="panel" aria-live="polite">
<h2>Details</h2>
<p class="hint">Hover or click a node, an edge or a block for its full spec; a click pins it, Escape releases.</p>
<div id="details"><ul id="summary">
{summary}
</ul></div>
</aside>
</main>
<script type="application/json" id="viz-data">{data}</script>
<script>{_JS}</script>
</body>
</html>
"""
