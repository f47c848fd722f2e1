// Starts Swagger UI on /docs with the service's own OpenAPI document (a file, so the page needs no inline script).
window.addEventListener("load", () => {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis],
  });
});
