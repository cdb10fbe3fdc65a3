"""The HTML report and its inline-SVG charts."""
