/**
 * jupyter-gpushare's JupyterLab (and Notebook 7) sidebar: the shared GPU at a glance.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { LabIcon } from '@jupyterlab/ui-components';

import { GPUSharePanel } from './panel';

export { GPUSharePanel } from './panel';
export * from './model';

const GPU_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
<g class="jp-icon3" fill="#616161">
<path d="M3 6h15a3 3 0 0 1 3 3v6a3 3 0 0 1-3 3H9v2H7v-2H5v2H3V6zm2 2v8h13a1 1 0 0 0 1-1V9a1 1 0 0 0-1-1H5z"/>
<circle cx="14" cy="12" r="2.5"/><rect x="7" y="10" width="3" height="4"/>
</g></svg>`;

export const gpuIcon = new LabIcon({ name: 'jupyter-gpushare:gpu', svgstr: GPU_SVG });

const PANEL_ID = 'jupyter-gpushare-sidebar';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-gpushare:sidebar',
  description: 'A sidebar showing who uses the shared GPU, who waits, and memory against quotas.',
  autoStart: true,
  optional: [ILayoutRestorer],
  activate: (app: JupyterFrontEnd, restorer: ILayoutRestorer | null) => {
    const panel = new GPUSharePanel({ serverSettings: app.serviceManager.serverSettings });
    panel.id = PANEL_ID;
    panel.title.icon = gpuIcon;
    panel.title.caption = 'Shared GPU';
    // 'left' exists in JupyterLab and in Notebook 7 (its side panel).
    app.shell.add(panel, 'left', { rank: 650 });
    if (restorer) {
      restorer.add(panel, PANEL_ID);
    }
    app.commands.addCommand('gpushare:show', {
      label: 'Show the Shared GPU Panel',
      caption: 'Who holds the GPU, who waits, and memory against quotas',
      execute: () => {
        app.shell.activateById(panel.id);
      }
    });
  }
};

export default plugin;
