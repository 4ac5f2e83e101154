"""The status page's static files (index.html, app.js, style.css): served as they are, no build step."""
