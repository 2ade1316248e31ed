/* deltalens report: draws the figures from the JSON data island with the inlined plotly.js. */
(function () {
  "use strict";
  var payload = JSON.parse(document.getElementById("deltalens-data").textContent);
  var config = {
    displaylogo: false,
    responsive: true,
    modeBarButtonsToRemove: ["select2d", "lasso2d"],
    toImageButtonOptions: {format: "png", scale: 2}
  };
  var state = {payload: payload, errors: [], rendered: [], heatmap: {metric: "l2", model: 0}};
  window.deltalens = state;

  function showError(el, err) {
    state.errors.push(String(err && err.message || err));
    el.innerHTML = "";
    var p = document.createElement("p");
    p.className = "fig-error";
    p.textContent = "This figure could not be drawn: " + (err && err.message || err);
    el.appendChild(p);
  }

  var jobs = payload.figures.map(function (fig) {
    var el = document.getElementById(fig.id);
    if (!el) { return Promise.resolve(); }
    var layout = Object.assign({}, fig.layout, {template: payload.template});
    try {
      return Promise.resolve(Plotly.newPlot(el, fig.data, layout, config)).then(function () {
        state.rendered.push(fig.id);
      }, function (err) { showError(el, err); });
    } catch (err) {
      showError(el, err);
      return Promise.resolve();
    }
  });

  // Heatmap: absolute/relative toggle and model selector, both restyle trace 0 of the heatmap figure.
  var hm = payload.heatmap;
  function drawHeatmap() {
    if (!hm) { return Promise.resolve(); }
    var el = document.getElementById(hm.figure);
    var model = hm.models[state.heatmap.model];
    var metric = hm.metrics[state.heatmap.metric];
    var update = {
      x: [model.x], y: [model.y], z: [model.z[state.heatmap.metric]],
      hovertemplate: [metric.hover], "colorbar.title.text": [metric.title]
    };
    return Plotly.restyle(el, update, [0]);
  }
  state.setHeatmap = function (metric, model) {
    if (metric !== undefined && metric !== null) { state.heatmap.metric = metric; }
    if (model !== undefined && model !== null) { state.heatmap.model = Number(model); }
    var buttons = document.querySelectorAll("#sec-fig-heatmap .seg-btn");
    Array.prototype.forEach.call(buttons, function (b) {
      var on = b.getAttribute("data-metric") === state.heatmap.metric;
      b.classList.toggle("active", on);
      b.setAttribute("aria-pressed", on ? "true" : "false");
    });
    return drawHeatmap();
  };
  if (hm) {
    Array.prototype.forEach.call(document.querySelectorAll("#sec-fig-heatmap .seg-btn"), function (b) {
      b.addEventListener("click", function () { state.setHeatmap(b.getAttribute("data-metric"), null); });
    });
    var select = document.getElementById("heatmap-model");
    if (select) {
      select.addEventListener("change", function () { state.setHeatmap(null, select.value); });
    }
  }

  state.ready = Promise.all(jobs).then(function () {
    document.body.setAttribute("data-rendered", String(state.rendered.length));
  });
})();
