/**
 * jupyter-gpushare's JupyterLab (and Notebook 7) extension: the sidebar with the shared GPU at a
 * glance, a status-bar item with my kernels' state, and notifications (your turn came, your idle
 * kernel was evicted or put to sleep, your kernel is near its quota), all switchable in the
 * settings (schema/plugin.json).
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, Notification } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { ITranslator, nullTranslator } from '@jupyterlab/translation';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { CellHinter } from './hint';
import { buildViewModel, IStatus, IViewModel } from './model';
import { DEFAULT_PREFS, INotifyPrefs, noticesBetween, statusBarText } from './notify';
import { GPUSharePanel } from './panel';

export { GPUSharePanel } from './panel';
export * from './hint';
export * from './model';
export * from './notify';

// A chip with four rows of pins, drawn on the 16 px grid so that it stays crisp at the sidebar's
// size (tests/ui/test_icon.py renders it at 16 px and checks it).
const GPU_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">
<g class="jp-icon3" fill="#616161">
<path fill-rule="evenodd" d="M3 3h10v10H3zM5 5v6h6V5z"/>
<path d="M7 7h2v2H7zM4 1h2v2H4zm3 0h2v2H7zm3 0h2v2h-2zM4 13h2v2H4zm3 0h2v2H7zm3 0h2v2h-2zM1 4h2v2H1zm0 3h2v2H1zm0 3h2v2H1zM13 4h2v2h-2zm0 3h2v2h-2zm0 3h2v2h-2z"/>
</g></svg>`;

export const gpuIcon = new LabIcon({ name: 'jupyter-gpushare:gpu', svgstr: GPU_SVG });

const PANEL_ID = 'jupyter-gpushare-sidebar';
const PLUGIN_ID = 'jupyter-gpushare:sidebar';
const COMMAND = 'gpushare:show';

interface IPrefs extends INotifyPrefs {
  statusBar: boolean;
  pollSeconds: number;
  cellHints: boolean;
}

function readPrefs(settings: ISettingRegistry.ISettings | null): IPrefs {
  const get = <T>(key: string, fallback: T): T => {
    const value = settings?.get(key).composite;
    return value === undefined || value === null ? fallback : (value as T);
  };
  return {
    notifyTurn: get('notifyTurn', DEFAULT_PREFS.notifyTurn),
    turnAfterSeconds: get('turnAfterSeconds', DEFAULT_PREFS.turnAfterSeconds),
    notifyEvicted: get('notifyEvicted', DEFAULT_PREFS.notifyEvicted),
    notifyQuota: get('notifyQuota', DEFAULT_PREFS.notifyQuota),
    statusBar: get('statusBar', true),
    pollSeconds: Math.max(1, get('pollSeconds', 3)),
    cellHints: get('cellHints', true)
  };
}

/** The kernel id of the notebook (or console) in the main area, if it has a kernel. */
function currentKernelId(app: JupyterFrontEnd): string | null {
  const widget = app.shell.currentWidget as unknown as {
    sessionContext?: { session?: { kernel?: { id?: string } | null } | null };
  } | null;
  return widget?.sessionContext?.session?.kernel?.id ?? null;
}

/** POST gpushare/api/kernels/{id}/hint: a cell of this kernel is coming (hint.ts). */
async function sendHint(settings: ServerConnection.ISettings, kernelId: string): Promise<void> {
  const url = URLExt.join(settings.baseUrl, 'gpushare/api/kernels', kernelId, 'hint');
  try {
    await ServerConnection.makeRequest(url, { method: 'POST', body: '' }, settings);
  } catch {
    // A hint is worth nothing once late: no retry, no message.
  }
}

/**
 * Looks at the status document every few seconds, whether the sidebar is shown or not, and
 * hands each view model to the status bar and the notifier.
 */
class StatusWatcher {
  constructor(
    private _settings: ServerConnection.ISettings,
    private _onModel: (model: IViewModel) => void
  ) {}

  start(seconds: number): void {
    this.stop();
    const tick = async () => {
      this._onModel(await this._fetch());
      this._timer = window.setTimeout(tick, seconds * 1000);
    };
    void tick();
  }

  stop(): void {
    if (this._timer !== null) {
      window.clearTimeout(this._timer);
      this._timer = null;
    }
  }

  private async _fetch(): Promise<IViewModel> {
    const url = URLExt.join(this._settings.baseUrl, 'gpushare/api/status');
    try {
      const response = await ServerConnection.makeRequest(url, {}, this._settings);
      if (response.ok) {
        return buildViewModel({ kind: 'status', status: (await response.json()) as IStatus });
      }
      return buildViewModel({ kind: 'error', statusCode: response.status, message: '' });
    } catch (err) {
      return buildViewModel({ kind: 'error', statusCode: null, message: String(err) });
    }
  }

  private _timer: number | null = null;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'A sidebar showing who uses the shared GPU, who waits, and memory against quotas.',
  autoStart: true,
  optional: [ILayoutRestorer, ICommandPalette, IStatusBar, ISettingRegistry, ITranslator],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    statusBar: IStatusBar | null,
    settingRegistry: ISettingRegistry | null,
    translator: ITranslator | null
  ) => {
    const trans = (translator ?? nullTranslator).load('jupyter_gpushare');
    const __ = (msg: string, ...args: unknown[]) => trans.__(msg, ...(args as string[]));
    const serverSettings = app.serviceManager.serverSettings;
    const panel = new GPUSharePanel({ serverSettings, translator: translator ?? undefined });
    panel.id = PANEL_ID;
    panel.title.icon = gpuIcon;
    panel.title.caption = __('Shared GPU');
    // 'left' exists in JupyterLab and in Notebook 7 (its side panel).
    app.shell.add(panel, 'left', { rank: 650 });
    if (restorer) {
      restorer.add(panel, PANEL_ID);
    }
    // A notebook's kernel that starts or stops is listed (or dropped) at once, with its path,
    // even before its first GPU call: the scheduler's document alone would not change.
    app.serviceManager.sessions.runningChanged.connect(() => {
      if (panel.isVisible) {
        void panel.refresh();
      }
    });
    app.commands.addCommand(COMMAND, {
      label: __('Show the Shared GPU Panel'),
      caption: __('Who holds the GPU, who waits, and memory against quotas'),
      icon: gpuIcon,
      execute: () => {
        app.shell.activateById(panel.id);
      }
    });
    if (palette) {
      palette.addItem({ command: COMMAND, category: __('GPU') });
    }

    let prefs = readPrefs(null);
    const item = new Widget();
    item.addClass('jp-gpushare-statusbar');
    item.node.title = __('Your kernels on the shared GPU (click for the panel)');
    item.node.addEventListener('click', () => void app.commands.execute(COMMAND));
    if (statusBar) {
      statusBar.registerStatusItem('jupyter-gpushare:status', {
        item,
        align: 'left',
        rank: 4,
        isActive: () => prefs.statusBar
      });
    }

    let previous: IViewModel | null = null;
    let latest: IViewModel | null = null;
    // Cell hints (hint.ts): the focus or an edit in a code cell of a notebook whose GPU-shared
    // kernel's memory is away tells the scheduler a cell is coming, debounced.
    const hinter = new CellHinter(kernelId => void sendHint(serverSettings, kernelId), {
      now: () => Date.now(),
      setTimeout: (fn, ms) => window.setTimeout(fn, ms),
      clearTimeout: handle => window.clearTimeout(handle)
    });
    const onCellActivity = (event: Event) => {
      const target = event.target as Element | null;
      if (prefs.cellHints && target?.closest?.('.jp-CodeCell')) {
        hinter.activity(latest, currentKernelId(app));
      }
    };
    document.addEventListener('focusin', onCellActivity, true);
    document.addEventListener('keydown', onCellActivity, true);
    const watcher = new StatusWatcher(serverSettings, model => {
      latest = model;
      item.node.textContent = statusBarText(model, __);
      item.node.dataset.state = model.state;
      for (const notice of noticesBetween(previous, model, prefs, __)) {
        Notification.emit(notice.text, notice.level, {
          autoClose: notice.level === 'warning' ? false : 8000
        });
      }
      if (model.state === 'ok' || previous === null) {
        previous = model; // a failed look does not count as "nothing of mine is there"
      }
    });

    const apply = (settings: ISettingRegistry.ISettings | null) => {
      prefs = readPrefs(settings);
      item.setHidden(!prefs.statusBar);
      watcher.start(prefs.pollSeconds);
    };
    if (settingRegistry) {
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          apply(settings);
          settings.changed.connect(() => apply(settings));
        })
        .catch(() => apply(null));
    } else {
      apply(null);
    }
  }
};

export default plugin;
