// sqlx-broker dashboard: refreshes the live part of a page (#live) every data-refresh seconds
// while the tab is visible. This is the only script the dashboard runs; pages work without it.
(function () {
  "use strict";
  var seconds = Number(document.body.getAttribute("data-refresh") || 0);
  if (!seconds) return;
  setInterval(function () {
    if (document.hidden) return;
    fetch(location.href, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (text) {
        if (!text) return;
        var next = new DOMParser().parseFromString(text, "text/html").getElementById("live");
        var live = document.getElementById("live");
        if (next && live) live.replaceWith(document.importNode(next, true));
      })
      .catch(function () {});
  }, seconds * 1000);
})();
